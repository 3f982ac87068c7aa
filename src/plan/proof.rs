//! `pipetrain plan --measure K`: the plan against real runs. The best layouts, the
//! default one and the cut rivals run for real (in one process, or launched on a
//! manifest's nodes here), in rounds taken in turn, beside a control that says how far
//! the machine drifted since the profile (`control`), run before each round and after
//! the last; each measured step is printed beside its prediction, then how the
//! predictions held, raw and with the drift at each run taken out.

use std::cell::Cell;
use std::path::Path;
use std::time::Instant;

use crate::cluster::ClusterManifest;
use crate::config::TrainConfig;
use crate::Result;

use super::command::PlanArgs;
use super::control::{steady_median, Control, Timed};
use super::proof_text::{accuracy, drift_text, Outcome};
use super::rounds::median;
use super::{Plan, PlanRow};

/// Each measured run's steps over the rounds, or why it failed.
type Seen = std::result::Result<Vec<Timed>, String>;

/// Runs `args.measure` of `p`'s best layouts (and the default, the cut rivals, the
/// fastest of each other layout) for real, `args.measure_rounds` times each, and prints
/// each one's measured step beside its prediction and how the predictions held.
/// Returns the fastest measured of those that fit, with its name and measured step.
///
/// # Errors
/// None yet: a run that fails is printed as failed.
pub(super) fn measure<'a>(
    p: &'a Plan,
    args: &PlanArgs,
    (cfg, worker): (&TrainConfig, &Path),
    manifest: Option<&ClusterManifest>,
) -> Result<Option<(&'a PlanRow, String)>> {
    let runs = measured_rows(p, args.measure);
    let rounds = args.measure_rounds.max(1);
    println!(
        "\nmeasured (at least {} steps each and {} s of steps, 2 not counted{}{}):",
        args.measure_steps,
        super::profile::TIMED_SECONDS,
        match manifest {
            Some(_) => ", each node a `pipetrain launch` process here",
            None => "",
        },
        match rounds {
            1 => String::new(),
            r => format!("; the median of {r} rounds, the runs in turn, and their spread"),
        }
    );
    // In one process: launched layouts pay what an in-process control does not show.
    let control = manifest
        .is_none()
        .then(|| Control::of(&p.profiles, worker, &args.config, cfg.global_batch()))
        .flatten();
    let measure = |row: &PlanRow| {
        // Long enough for the clock to see the steps.
        let steps = super::profile::steps_lasting(
            super::profile::TIMED_SECONDS,
            row.simulated.step,
            args.measure_steps,
        );
        match manifest {
            Some(m) => {
                let at = (p.threads, steps, 2);
                super::cluster::measure_launched(worker, (&args.config, m), row, at)
            }
            None => super::measure_step(worker, &args.config, row, (steps, 2)),
        }
        .map_err(|e| e.to_string())
    };
    let (steps, peaks, drifts) = in_rounds(&runs, rounds, control.as_ref(), &measure);
    let measured = print_table(runs.clone(), steps, &drifts);
    print!("{}", memory_text(&runs, &peaks));
    print!("{}", accuracy(&measured));
    if let Some(c) = &control {
        print!("{}", drift_text(&measured, &drifts, &c.name()));
    }
    Ok(fastest_fitting(p, &runs, &measured))
}

/// Of the measured `runs` whose predicted peak fits the memory cap (the plan's rows,
/// and the default and the cut rivals too: a trial run settles it), the fastest
/// measured, said by its name and measured step; `None` where none ran.
fn fastest_fitting<'a>(
    p: &Plan,
    runs: &[(String, &'a PlanRow)],
    measured: &[Outcome],
) -> Option<(&'a PlanRow, String)> {
    let fits = |row: &PlanRow| row.fits(&p.cap);
    let (o, row) = measured
        .iter()
        .filter_map(|o| {
            let (_, row) = runs.iter().find(|(name, _)| *name == o.name)?;
            fits(row).then_some((o, *row))
        })
        .min_by(|a, b| a.0.measured.total_cmp(&b.0.measured))?;
    Some((row, format!("{}, {:.2} ms", o.name, o.measured * 1e3)))
}

/// Each of `runs` measured `rounds` times, the runs in turn each round after the
/// control's, and the control once more after the last round; each run's process peak
/// (the highest of its rounds); and the control's drift each time it ran.
fn in_rounds(
    runs: &[(String, &PlanRow)],
    rounds: usize,
    control: Option<&Control<'_>>,
    measure: &dyn Fn(&PlanRow) -> std::result::Result<super::Measured, String>,
) -> (Vec<Seen>, Vec<Option<u64>>, Vec<Timed>) {
    let start = Instant::now();
    let timed = |run: &dyn Fn() -> std::result::Result<f64, String>| {
        let from = start.elapsed().as_secs_f64();
        let value = run()?;
        let at = (from + start.elapsed().as_secs_f64()) / 2.0;
        Ok::<Timed, String>(Timed { value, at })
    };
    let mut drifts = Vec::new();
    let mut control_run = || match control.map(|c| timed(&|| c.drift())) {
        Some(Ok(d)) => drifts.push(d),
        Some(Err(e)) => tracing::warn!("the control run failed: {e}"),
        None => {}
    };
    let mut steps: Vec<Seen> = vec![Ok(Vec::new()); runs.len()];
    // Each run's process peak, the highest of its rounds.
    let mut peaks: Vec<Option<u64>> = vec![None; runs.len()];
    for _ in 0..rounds {
        control_run();
        for (((_, row), got), most) in runs.iter().zip(&mut steps).zip(&mut peaks) {
            if let Ok(seen) = got {
                let peak = Cell::new(None);
                let run = || {
                    let m = measure(row)?;
                    peak.set(m.peak);
                    Ok(m.step)
                };
                match timed(&run) {
                    Ok(step) => seen.push(step),
                    Err(e) => *got = Err(e),
                }
                *most = (*most).max(peak.get());
            }
        }
    }
    control_run();
    (steps, peaks, drifts)
}

/// Prints each run's prediction, measured median and spread; returns those that ran,
/// each with its steps' median with the control's `drifts` taken out.
fn print_table(runs: Vec<(String, &PlanRow)>, steps: Vec<Seen>, drifts: &[Timed]) -> Vec<Outcome> {
    println!("rank           predicted ms  measured ms  error   layout");
    let mut measured = Vec::new();
    for ((name, row), got) in runs.into_iter().zip(steps) {
        let seen = match got {
            Ok(seen) => seen,
            Err(e) => {
                println!("{name:<14} failed: {e}");
                continue;
            }
        };
        let steady = steady_median(&seen, drifts);
        let mut seen: Vec<f64> = seen.iter().map(|s| s.value).collect();
        seen.sort_by(f64::total_cmp);
        let median = median(&seen).unwrap_or(f64::NAN);
        let spread = match seen.len() {
            1 => String::new(),
            _ => format!(" [{:.2}-{:.2}]", seen[0] * 1e3, seen[seen.len() - 1] * 1e3),
        };
        let err = row.simulated.step / median - 1.0;
        println!(
            "{name:<14} {:>12.2}  {:>11.2}  {:>+5.1}%  {}{spread}",
            row.simulated.step * 1e3,
            median * 1e3,
            err * 100.0,
            super::layout_text(&row.candidate)
        );
        measured.push(Outcome {
            name,
            predicted: row.simulated.step,
            measured: median,
            spread: (seen[0], seen[seen.len() - 1]),
            steady,
        });
    }
    measured
}

/// Each run's measured process peak (the highest of its rounds) beside the plan's
/// prediction for that process (node 0's in a launched job), in GB: empty where no run
/// said.
fn memory_text(runs: &[(String, &PlanRow)], peaks: &[Option<u64>]) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let said: Vec<String> = runs
        .iter()
        .zip(peaks)
        .filter_map(|((name, row), peak)| {
            let peak = (*peak)?;
            let predicted = row.processes.first().copied().unwrap_or(0);
            Some(format!("{name} {:.3}/{:.3}", gb(peak), gb(predicted)))
        })
        .collect();
    match said.is_empty() {
        true => String::new(),
        false => format!(
            "peak memory of each run's process (node 0's when launched), measured/predicted \
             GB: {}\n",
            said.join(", ")
        ),
    }
}

/// What `--measure K` runs, named: the best `k` that fit, the default layout, the
/// fastest pipeline layout cut by time and its rivals, then the fastest of each (dp, tp,
/// pp) layout not among them. A layout with the same cuts as one already named runs once,
/// under both names (`4 = by time`): measured twice, the machine's drift would set one
/// run against itself.
fn measured_rows(p: &Plan, k: usize) -> Vec<(String, &PlanRow)> {
    let mut runs: Vec<(String, &PlanRow)> = Vec::new();
    fn push<'a>(runs: &mut Vec<(String, &'a PlanRow)>, name: String, row: &'a PlanRow) {
        let same =
            |t: &&mut (String, &PlanRow)| t.1.candidate == row.candidate && t.1.cuts == row.cuts;
        match runs.iter_mut().find(same) {
            Some(t) => t.0 = format!("{} = {name}", t.0),
            None => runs.push((name, row)),
        }
    }
    let fit = p.fitting();
    for (i, r) in fit.take(k).enumerate() {
        push(&mut runs, format!("{}", i + 1), r);
    }
    if let Some(d) = &p.default {
        push(&mut runs, "default".into(), d);
    }
    if let Some(time) = p
        .cut_rivals
        .first()
        .and_then(|(_, r)| p.rows.iter().find(|t| t.candidate == r.candidate))
    {
        push(&mut runs, "by time".into(), time);
        for (by, r) in &p.cut_rivals {
            push(&mut runs, format!("by {by}"), r);
        }
    }
    for r in p.fitting() {
        let c = &r.candidate;
        let layout = (c.dp, c.tp, c.pp);
        let seen = |t: &(String, &PlanRow)| {
            let o = &t.1.candidate;
            (o.dp, o.tp, o.pp) == layout
        };
        if !runs.iter().any(seen) {
            runs.push((format!("{}x{}x{}", c.dp, c.tp, c.pp), r));
        }
    }
    runs
}
