//! `pipetrain plan --profile-cache FILE`: the profile measured once and planned from
//! again. Profiling is most of a plan's time (1.5-4 minutes on the benches' models); with
//! the cache a second plan of the same model, with another memory cap or more layouts
//! printed or measured, starts from what the first one measured.
//!
//! The file keeps what was measured, before anything is fitted to it: each profile as
//! its runs left it and the machine's own runs ([`MachineRuns`]). The plan fits the
//! overheads, the machine's costs and the stages' costs again from them, so a plan from
//! the cache is the plan the measurements give, whatever this version fits.
//!
//! It is reused only for what it was measured for ([`MadeFor`]): the same configuration
//! file and model file (by content), machine (host name and cores), workers, threads,
//! global batch and profile settings. Otherwise the plan says what differs and measures
//! again, replacing it; a cache another pipetrain laid out is measured again too. A
//! file that is not such a cache is refused, and left as it is. The memory cap is not
//! part of it: it ranks the layouts, and only where one worker cannot hold the model
//! does it decide how a profile's runs are cut (a profile in one stage serves any cap).
//! What a process holds beside its ranks is kept with the profile, so a plan from the
//! cache prints the same table. Over a cluster manifest, the link and the launched jobs
//! it is calibrated against are measured again each time: they are the cluster's, not
//! the model's.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::machine::MachineRuns;
use super::{plan_error, PlanOptions, Profile, Profiles};
use crate::checkpoint::now_unix_s;
use crate::config::TrainConfig;
use crate::{Error, Result};

/// The layout of the file; another is measured again (2: the profiles hold their
/// ZB-H1 run's stages, which the nodes' shares are set against; 3: those stages from a
/// one-rank run instead; 4: the two-replica run's updates measured against one
/// replica's; 5: the unsplit families' runs' last stage against their other stages; 6:
/// the GPipe run's hand-offs of activations and gradients apart; 7: the pipeline runs
/// cut where the nodes' times balance, and the cuts kept).
const FORMAT: u32 = 7;

/// What a profile was measured for: a cache is reused only where all of it matches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct MadeFor {
    /// The file's layout.
    pub format: u32,
    /// The pipetrain that measured it.
    pub pipetrain: String,
    /// The machine's host name.
    pub host: String,
    /// SHA-256 of the configuration file and the model file it names.
    pub model: String,
    /// This machine's cores.
    pub cores: usize,
    /// Workers laid out.
    pub workers: usize,
    /// Intra-op threads per session.
    pub threads: usize,
    /// The configuration's global batch.
    pub global_batch: usize,
    /// The most micro-batches a step tried.
    pub max_micro_batches: usize,
    /// Steps of each profile run, at least.
    pub profile_steps: usize,
    /// Rounds of the timed runs.
    pub profile_rounds: usize,
}

impl MadeFor {
    /// What a plan of `cfg` (read from `config`) with `opts` measures for, on this
    /// machine's `cores` at `threads` threads a session, profile runs of `steps` steps.
    ///
    /// # Errors
    /// `Io` when the configuration or model file cannot be read.
    pub(super) fn of(
        (cfg, config): (&TrainConfig, &Path),
        opts: &PlanOptions<'_>,
        (cores, threads, steps): (usize, usize, usize),
    ) -> Result<MadeFor> {
        Ok(MadeFor {
            format: FORMAT,
            pipetrain: env!("CARGO_PKG_VERSION").into(),
            host: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .or_else(|_| std::env::var("HOSTNAME"))
                .unwrap_or_default()
                .trim()
                .to_string(),
            model: Self::model_of(cfg, config)?,
            cores,
            workers: opts.workers,
            threads,
            global_batch: cfg.global_batch(),
            max_micro_batches: opts.max_micro_batches,
            profile_steps: steps,
            profile_rounds: opts.profile_rounds,
        })
    }

    /// The fingerprint of `cfg` (read from `config`): its file's and its model file's
    /// content.
    ///
    /// # Errors
    /// `Io` when either file cannot be read.
    fn model_of(cfg: &TrainConfig, config: &Path) -> Result<String> {
        let mut h = Sha256::new();
        h.update(std::fs::read(config).map_err(Error::io(config))?);
        let model = &cfg.model_path;
        if !model.as_os_str().is_empty() && model.exists() {
            h.update(std::fs::read(model).map_err(Error::io(model))?);
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The fields in which `self` and `other` differ, by name.
    fn differences(&self, other: &MadeFor) -> Vec<String> {
        let (a, b) = (serde_json::to_value(self), serde_json::to_value(other));
        let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) = (a, b) else {
            return vec!["everything".into()];
        };
        a.iter()
            .filter(|(k, v)| b.get(*k) != Some(*v))
            .map(|(k, v)| {
                format!(
                    "{k} {v} (now {})",
                    b.get(k).unwrap_or(&serde_json::Value::Null)
                )
            })
            .collect()
    }
}

/// What a plan measures before it fits anything.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Measured {
    /// What it was measured for (set as it is written).
    pub made_for: Option<MadeFor>,
    /// The profiles, as their runs left them.
    pub profiles: Vec<Profile>,
    /// Micro-batch sizes whose profile failed, and why.
    pub skipped: Vec<(usize, String)>,
    /// The machine's own runs.
    pub machine: MachineRuns,
    /// Seconds the measuring took.
    pub seconds: f64,
    /// When it finished, seconds since the Unix epoch (0: not said).
    #[serde(default)]
    pub finished: u64,
    /// What a process held beside its ranks when it was measured (`process`), so that a
    /// plan from the cache is the same plan (`None` in a cache written before it was
    /// kept: measured again).
    #[serde(default)]
    pub process: Option<super::process::ProcessBase>,
}

impl Measured {
    /// Seconds since it was measured (`None`: not said).
    pub(super) fn age(&self) -> Option<u64> {
        (self.finished > 0).then(|| now_unix_s().saturating_sub(self.finished))
    }

    /// The profiles by (tensor shards, micro-batch).
    pub(super) fn by_size(&self) -> Profiles {
        let at = |p: &Profile| ((p.shards, p.micro_batch), p.clone());
        self.profiles.iter().map(at).collect()
    }
}

/// The measurements in `path` where they were made for `made_for`; else `measure()`'s,
/// written to `path`. `.1`: whether they were read.
///
/// # Errors
/// `Plan` when `path` holds something that is not such a cache (left as it is), or
/// what `measure` returns; `Io` when the file cannot be read or written.
pub(super) fn load_or_measure(
    path: &Path,
    made_for: &MadeFor,
    measure: impl FnOnce() -> Result<Measured>,
) -> Result<(Measured, bool)> {
    if path.exists() {
        let text = std::fs::read(path).map_err(Error::io(path))?;
        let refused = |why: String| {
            plan_error(
                &format!("the profile cache {}", path.display()),
                format!("it is not a profile `pipetrain plan` wrote ({why}); name another file"),
            )
        };
        let value: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| refused(e.to_string()))?;
        if value.pointer("/made_for/format").is_none() {
            return Err(refused("no `made_for.format`".into()));
        }
        let differs = match serves(value, made_for) {
            Ok(cached) => return Ok((cached, true)),
            Err(differs) => differs,
        };
        tracing::warn!(
            "{} was measured for another plan ({}): measuring again",
            path.display(),
            differs.join(", ")
        );
    }
    writable(path)?;
    let measured = Measured {
        made_for: Some(made_for.clone()),
        ..measure()?
    };
    let text = serde_json::to_vec_pretty(&measured)
        .map_err(|e| plan_error("the profile cache", e.to_string()))?;
    crate::onnx::save_bytes(path, &text)?;
    Ok((measured, false))
}

/// Makes `path`'s folder where it is missing and checks that a file can be written
/// there, before minutes of profiling would be lost to a cache that cannot be kept.
///
/// # Errors
/// `Io` naming the folder.
fn writable(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    let probe = dir.join(format!(".pipetrain-cache-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(Error::io(dir))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The cache `value` holds where it was measured for `made_for`; else what differs
/// (another pipetrain's layout among them).
fn serves(
    value: serde_json::Value,
    made_for: &MadeFor,
) -> std::result::Result<Measured, Vec<String>> {
    let cached: Measured = serde_json::from_value(value)
        .map_err(|e| vec![format!("the layout of another pipetrain ({e})")])?;
    let differs = match &cached.made_for {
        Some(m) => m.differences(made_for),
        None => vec!["nothing said".into()],
    };
    match differs.is_empty() {
        true => Ok(cached),
        false => Err(differs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made_for(workers: usize) -> MadeFor {
        MadeFor {
            format: FORMAT,
            pipetrain: "0".into(),
            host: "here".into(),
            model: "ab".into(),
            cores: 2,
            workers,
            threads: 1,
            global_batch: 4,
            max_micro_batches: 8,
            profile_steps: 8,
            profile_rounds: 1,
        }
    }

    fn measured() -> Measured {
        Measured {
            made_for: None,
            profiles: Vec::new(),
            skipped: vec![(3, "a reason".into())],
            machine: MachineRuns::default(),
            seconds: 1.5,
            finished: now_unix_s(),
            process: None,
        }
    }

    #[test]
    fn a_cache_is_read_for_what_it_was_made_for_and_measured_again_for_anything_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.json");
        // None yet: measured and written.
        let (m, read) = load_or_measure(&path, &made_for(2), || Ok(measured())).unwrap();
        assert!(!read);
        assert_eq!(m.seconds, 1.5);
        // The same plan: read, nothing measured.
        let fail = || Err(plan_error("measuring", "must not run"));
        let (m, read) = load_or_measure(&path, &made_for(2), fail).unwrap();
        assert!(read);
        assert_eq!(m.skipped, vec![(3, "a reason".to_string())]);
        // Other workers: measured again and written over it.
        let (_, read) = load_or_measure(&path, &made_for(4), || Ok(measured())).unwrap();
        assert!(!read);
        let (m, read) = load_or_measure(&path, &made_for(4), fail).unwrap();
        assert!(read && m.made_for.is_some_and(|m| m.workers == 4));
        assert_eq!(
            made_for(2).differences(&made_for(4)),
            vec!["workers 2 (now 4)".to_string()]
        );
    }

    #[test]
    fn a_cache_another_pipetrain_laid_out_is_measured_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.json");
        std::fs::write(&path, r#"{"made_for": {"format": 0}, "profiles": 3}"#).unwrap();
        let (m, read) = load_or_measure(&path, &made_for(2), || Ok(measured())).unwrap();
        assert!(!read && m.made_for.is_some());
        let (_, read) = load_or_measure(&path, &made_for(2), || unreachable!()).unwrap();
        assert!(read);
    }

    #[test]
    fn a_missing_folder_is_made_and_one_that_cannot_be_is_said_before_measuring() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("caches/gpt2.json");
        let (_, read) = load_or_measure(&path, &made_for(2), || Ok(measured())).unwrap();
        assert!(!read && path.exists());
        // A file where the folder would be: refused before anything is measured.
        let blocked = dir.path().join("caches/gpt2.json/inner.json");
        let err = load_or_measure(&blocked, &made_for(2), || unreachable!()).unwrap_err();
        assert!(err.to_string().contains("gpt2.json"), "{err}");
    }

    #[test]
    fn a_file_that_is_not_a_cache_is_refused_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.toml");
        std::fs::write(&path, "batch_size = 4\n").unwrap();
        let err = load_or_measure(&path, &made_for(2), || Ok(measured())).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("train.toml") && text.contains("not a profile"),
            "{text}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "batch_size = 4\n");
    }
}
