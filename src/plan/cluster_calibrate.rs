//! A cluster's costs calibrated against jobs launched on its nodes, where they are all
//! on this machine: what the echo between two warm mesh endpoints (`link`) does not show.
//!
//! - Two pipelines, the profile's ZB-H1 run in as many stages as the nodes have slots,
//!   one at the smallest profiled micro-batch (the most messages a step) and one at the
//!   largest (the most bytes a message). What a message waits more where it finds its
//!   receiver idle (another process's sleeping threads woken: the transport's, then the
//!   actor's) and its work per byte (fresh buffers faulted in, caches other processes
//!   took; from the echo's figure up: a job's messages cost at least what the echo's
//!   did) are fitted to both at once.
//! - Replicas, one a slot, in separate processes: how much their actions slow each
//!   other (at most as much as in one process, where two replicas also share an
//!   allocator and ONNX Runtime's environment), and what keeping them in step costs a
//!   step beside the ring.
//!
//! Each is the value at which the simulator, with everything else as measured, predicts
//! the launched run's step, read from node 0's metrics.

use std::path::Path;

use crate::cluster::ClusterManifest;
use crate::cost::{simulate_on_nodes, Family, Link, Machinery, Nodes, Profile, Rate};
use crate::graph::{BalanceBy, Recompute};
use crate::{Error, Result};

use super::calibrate::solve;
use super::cluster::{launch_here, period};
use super::profile::ProfileRun;
use super::runs::{profile_config, RunKind};
use super::{plan_error, Candidate, Profiles, Sharded};

/// The most a launched job's message work is taken to exceed the echo's, times.
const MOST_WORK: f64 = 20.0;

/// A launched run's layout, costs and measured step.
struct Launched<'a> {
    profile: &'a Profile,
    c: Candidate,
    bounds: Option<Vec<usize>>,
    step: f64,
}

/// The cluster's link, interference and replicas' cost, calibrated against jobs launched
/// on `manifest`'s nodes here; what a launch cannot show is left as measured, with a
/// warning.
pub fn calibrate(
    run: &ProfileRun<'_>,
    profiles: &Profiles,
    (whole, machinery): (&Sharded, &Machinery),
    (manifest, nodes, link): (&ClusterManifest, &Nodes, Link),
) -> Calibrated {
    let warn = |e: Error| tracing::warn!("{e}; left as measured");
    let at = Machinery {
        link: Some(link),
        ..*machinery
    };
    let pipelines: Vec<Launched<'_>> =
        pipeline_profiles(profiles, (run.global_batch, nodes.total()))
            .into_iter()
            .filter_map(|(p, family)| {
                pipeline(run, (p, family), whole, (manifest, nodes))
                    .map_err(warn)
                    .ok()
            })
            .collect();
    let link = fit_link(&pipelines, (whole, &at), nodes);
    let at = Machinery {
        link: Some(link),
        ..at
    };
    let (contention, replica_sync) = match replicas(run, profiles, (manifest, nodes)) {
        Ok(Some(r)) => fit_replicas(&r, (whole, &at), nodes),
        Ok(None) => (machinery.contention, machinery.replica_sync),
        Err(e) => {
            warn(e);
            (machinery.contention, machinery.replica_sync)
        }
    };
    Calibrated {
        link,
        contention,
        replica_sync,
    }
}

/// What the launched runs set.
pub struct Calibrated {
    /// The link between two nodes.
    pub link: Link,
    /// How much each further action running at once slows the others.
    pub contention: f64,
    /// What keeping the replicas in step adds to a step.
    pub replica_sync: f64,
}

/// The interference of replicas in separate processes, and what keeping them in step
/// costs: the interference fitted up to the one measured in one process (which shares
/// more: an allocator, ONNX Runtime's environment), then the rest of the launched run's
/// step set on keeping them in step (a step's cost, which pipelines of one replica do not
/// pay).
fn fit_replicas(r: &Launched<'_>, (whole, m): (&Sharded, &Machinery), nodes: &Nodes) -> (f64, f64) {
    let in_one = m.contention;
    let contention = fit(
        r,
        (whole, m),
        nodes,
        &|c| Machinery {
            contention: c,
            ..*m
        },
        (0.0, in_one),
    );
    let at = Machinery { contention, ..*m };
    let most = m.replica_sync + r.profile.total() * r.c.micro_batches as f64;
    let sync = |s| Machinery {
        replica_sync: s,
        ..at
    };
    let replica_sync = fit(r, (whole, &at), nodes, &sync, (m.replica_sync, most));
    (contention, replica_sync)
}

/// The unsplit one-stage profiles whose pipeline runs were made, each with the family
/// whose run it launches: where their micro-batches fill `stages` ZB-H1 stages, the
/// smallest and the largest micro-batch (one where they are the same) under ZB-H1; and
/// the largest whose micro-batches do not (a lone micro-batch, say) under GPipe, where
/// every hand-off finds its receiver idle. Without that run the receiver's waking was
/// left to runs that seldom show it: the Llama fixture's link was fitted with none, and
/// its launched pipelines of one micro-batch came out 13-24% fast.
fn pipeline_profiles(
    profiles: &Profiles,
    (global, stages): (usize, usize),
) -> Vec<(&Profile, Family)> {
    let made = |family: Family| {
        profiles
            .values()
            .filter(move |p| p.shards == 1 && p.stages == 1 && p.periods[family] > 0.0)
    };
    let fills = |p: &&Profile| global / p.micro_batch.max(1) >= stages;
    let filled: Vec<&Profile> = made(Family::Split).filter(fills).collect();
    let smallest = filled.iter().min_by_key(|p| p.micro_batch);
    let largest = filled.iter().max_by_key(|p| p.micro_batch);
    let mut out: Vec<(&Profile, Family)> = smallest
        .into_iter()
        .chain(largest)
        .map(|&p| (p, Family::Split))
        .collect();
    out.dedup_by_key(|(p, _)| p.micro_batch);
    let idle = made(Family::Unsplit).filter(|p| !fills(p));
    out.extend(
        idle.max_by_key(|p| p.micro_batch)
            .map(|p| (p, Family::Unsplit)),
    );
    out
}

/// Grid points a side of [`fit_link`]'s search.
const GRID: usize = 24;

/// The waking of an idle receiver and the message's work per byte that together bring
/// the launched pipelines' simulated steps closest to their measured ones (least squares
/// of the relative errors over a grid: waking from none to one micro-batch's compute,
/// work from the echo's up to [`MOST_WORK`] times it, geometrically; the least of each
/// where the runs cannot tell them apart).
fn fit_link(runs: &[Launched<'_>], (whole, m): (&Sharded, &Machinery), nodes: &Nodes) -> Link {
    let (Some(echo), Some(first)) = (m.link, runs.first()) else {
        return m.link.unwrap_or(Link {
            message: Rate {
                latency: 0.0,
                per_byte: 0.0,
            },
            message_work: 0.0,
            wake: 0.0,
            segment: Rate {
                latency: 0.0,
                per_byte: 0.0,
            },
        });
    };
    let with = |wake: f64, work: f64| Machinery {
        link: Some(Link {
            message_work: work,
            wake,
            ..echo
        }),
        ..*m
    };
    let step = |r: &Launched<'_>, at: &Machinery| {
        let on = (at, Some(nodes));
        simulate_on_nodes(&r.c, r.profile, whole.costs(), on, r.bounds.clone().into())
            .map(|s| s.step)
    };
    let most_wake = first.profile.total();
    let wakes = (0..GRID).map(|k| most_wake * k as f64 / (GRID - 1) as f64);
    let grid = wakes.flat_map(|wake| {
        (0..GRID).map(move |k| {
            let work = echo.message_work * MOST_WORK.powf(k as f64 / (GRID - 1) as f64);
            (wake, work)
        })
    });
    let error = |&(wake, work): &(f64, f64)| -> f64 {
        let at = with(wake, work);
        runs.iter()
            .map(|r| step(r, &at).map_or(f64::INFINITY, |t| (t / r.step - 1.0).powi(2)))
            .sum()
    };
    let scored = grid.map(|p| (error(&p), p));
    let (_, (wake, work)) = scored
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap_or((0.0, (echo.wake, echo.message_work)));
    Link {
        message_work: work,
        wake,
        ..echo
    }
}

/// The value in `(low, high)` at which `machinery(value)` simulates `r` to its measured
/// step (the simulated step growing with the value).
fn fit(
    r: &Launched<'_>,
    (whole, _): (&Sharded, &Machinery),
    nodes: &Nodes,
    machinery: &dyn Fn(f64) -> Machinery,
    (low, high): (f64, f64),
) -> f64 {
    let step_at = |value: f64| {
        let m = machinery(value);
        let on = (&m, Some(nodes));
        simulate_on_nodes(&r.c, r.profile, whole.costs(), on, r.bounds.clone().into())
            .map(|s| s.step)
    };
    solve(&step_at, r.step, (low, high.max(low)))
}

/// `profile`'s run of `family` (one stage a rank) in as many stages as `manifest` has
/// slots, cut by FLOPs as `train` cuts it, launched on its nodes.
fn pipeline<'a>(
    run: &ProfileRun<'_>,
    (profile, family): (&'a Profile, Family),
    whole: &Sharded,
    (manifest, nodes): (&ClusterManifest, &Nodes),
) -> Result<Launched<'a>> {
    let b = profile.micro_batch;
    let c = Candidate {
        dp: 1,
        tp: 1,
        pp: nodes.total(),
        schedule: family.run().0,
        virtual_stages: 1,
        micro_batches: run.global_batch / b,
        micro_batch: b,
        recompute: Recompute::None,
        zero: 0,
    };
    let bounds = whole
        .balanced_bounds(c.pp, BalanceBy::Flops)
        .filter(|bounds| bounds.len() + 1 == c.pp)
        .ok_or_else(|| failed(format!("the model cannot be cut in {}", c.pp)))?;
    let step = launched(run, profile, manifest, &c, RunKind::Pipeline(family))?;
    Ok(Launched {
        profile,
        c,
        bounds: Some(bounds),
        step,
    })
}

/// One replica a slot of the largest one-stage profile whose micro-batches they can
/// share, launched on `manifest`'s nodes (`None`: no such profile).
fn replicas<'a>(
    run: &ProfileRun<'_>,
    profiles: &'a Profiles,
    (manifest, nodes): (&ClusterManifest, &Nodes),
) -> Result<Option<Launched<'a>>> {
    let dp = nodes.total();
    let Some(profile) = profiles
        .values()
        .filter(|p| p.shards == 1 && p.stages == 1 && run.global_batch % (dp * p.micro_batch) == 0)
        .max_by_key(|p| p.micro_batch)
    else {
        return Ok(None);
    };
    let b = profile.micro_batch;
    let c = Candidate::one_f_one_b((dp, 1, 1), (run.global_batch / (dp * b), b));
    let step = launched(run, profile, manifest, &c, RunKind::FusedPair)?;
    Ok(Some(Launched {
        profile,
        c,
        bounds: None,
        step,
    }))
}

/// The step of the profile run of `kind` at `profile`'s micro-batch, laid out as `c`,
/// launched on `manifest`'s nodes.
fn launched(
    run: &ProfileRun<'_>,
    profile: &Profile,
    manifest: &ClusterManifest,
    c: &Candidate,
    kind: RunKind,
) -> Result<f64> {
    let long = run.as_long_as(profile);
    let config = profile_config(&long, (profile.threads, c.micro_batch), kind)?;
    let dir = std::env::temp_dir().join(format!(
        "pipetrain-plan-{}-{}",
        std::process::id(),
        kind.tag()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
    let ran = laid_out(&config, c, long.steps)
        .and_then(|()| launch_here(run.worker, &config, manifest, c, &dir))
        .and_then(|()| period(&dir.join("metrics.jsonl"), long.warmup));
    let _ = std::fs::remove_file(&config);
    let _ = std::fs::remove_dir_all(&dir);
    ran.map_err(failed)
}

/// The configuration at `path` laid out as `c`, the global batch kept, `steps` optimizer
/// steps.
fn laid_out(path: &Path, c: &Candidate, steps: usize) -> std::result::Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut t: toml::Table = toml::from_str(&text).map_err(|e| e.to_string())?;
    let int = |v: usize| toml::Value::Integer(v as i64);
    t.insert("data_parallel_size".into(), int(c.dp));
    t.insert("pipeline_parallel_size".into(), int(c.pp));
    t.insert("gradient_accumulation_steps".into(), int(c.micro_batches));
    t.insert("num_train_steps".into(), int(steps * c.micro_batches));
    t.insert("display_loss_steps".into(), int(steps * c.micro_batches));
    let text = toml::to_string(&t).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

fn failed(reason: String) -> Error {
    plan_error("calibrating the cluster against a launched job", reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::PerFamily;

    /// A one-stage profile at micro-batches of `b` whose runs of `made` were made.
    fn profile(b: usize, made: &[Family]) -> Profile {
        let mut periods = PerFamily::default();
        made.iter().for_each(|&f| periods[f] = 1e-3);
        Profile {
            shards: 1,
            stages: 1,
            threads: 1,
            micro_batch: b,
            periods,
            ..Profile::default()
        }
    }

    #[test]
    fn the_launched_pipelines_span_the_sizes_and_one_has_every_receiver_idle() {
        use Family::{Split, Unsplit, V};
        let all = [Unsplit, Split, V];
        let profiles: Profiles = [
            (1, profile(1, &all)),
            (2, profile(2, &all)),
            (4, profile(4, &all)),
            // ZB-H1 cannot run a lone micro-batch of 8.
            (8, profile(8, &[Unsplit, V])),
        ]
        .into_iter()
        .map(|(b, p)| ((1, b), p))
        .collect();
        let picked = |stages| -> Vec<(usize, Family)> {
            pipeline_profiles(&profiles, (8, stages))
                .into_iter()
                .map(|(p, f)| (p.micro_batch, f))
                .collect()
        };
        // Two stages: micro-batches of 1 and 4 fill them under ZB-H1; a lone
        // micro-batch of 8 runs GPipe.
        assert_eq!(picked(2), [(1, Split), (4, Split), (8, Unsplit)]);
        // Four stages: micro-batches of 4 (two a step) do not fill them either.
        assert_eq!(picked(4), [(1, Split), (2, Split), (8, Unsplit)]);
    }
}
