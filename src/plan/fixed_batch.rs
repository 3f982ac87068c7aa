//! A model exported with a fixed batch (its input's first axis a number, as `pipetrain
//! check` reports it) trains micro-batches of that size alone: the plan searches those
//! and says why, rather than profiling sizes whose runs can only fail.

use crate::config::TrainConfig;
use crate::{Error, Result};

use super::{plan_error, search::Candidate};

/// Keeps of `candidates` those at the model's fixed batch, where it has one, and
/// returns that input and batch (`None`: a dynamic batch, every candidate kept).
///
/// # Errors
/// The model cannot be read; `Plan` where no layout of `workers` cuts the global batch
/// into micro-batches of the fixed size.
pub(super) fn keep_its_size(
    cfg: &TrainConfig,
    workers: usize,
    candidates: &mut Vec<Candidate>,
) -> Result<Option<(String, usize)>> {
    let fixed = fixed_batch(cfg)?;
    if let Some((input, n)) = &fixed {
        candidates.retain(|c| c.micro_batch == *n);
        if candidates.is_empty() {
            let global = cfg.global_batch();
            return Err(plan_error(
                "the search",
                format!(
                    "the model's input `{input}` has a fixed batch of {n}, and no layout of \
                     {workers} workers cuts the global batch of {global} into micro-batches \
                     of {n}"
                ),
            ));
        }
    }
    Ok(fixed)
}

/// The first of the model's inputs declared with a fixed batch (a number as its first
/// axis, as `pipetrain check` finds it) and that number: a model exported so trains
/// micro-batches of that size alone. A model file is decoded without its external
/// data: the inputs are all it needs.
///
/// # Errors
/// The model cannot be read or decoded.
fn fixed_batch(cfg: &TrainConfig) -> Result<Option<(String, usize)>> {
    let model = match &cfg.model {
        Some(spec) => crate::models::build(spec)?,
        None => {
            let path = &cfg.model_path;
            let bytes = std::fs::read(path).map_err(Error::io(path))?;
            crate::onnx::decode_model(&bytes, path)?
        }
    };
    let Some(g) = &model.graph else {
        return Ok(None);
    };
    let found = crate::graph::check::fixed_batch_of(&g.input, &g.initializer);
    Ok(found
        .into_iter()
        .next()
        .map(|(input, n)| (input, n.max(1) as usize)))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// The built-in MLP, its batch axis `batch` (a number where given).
    fn mlp(batch: &str) -> TrainConfig {
        let text = format!(
            "batch_size = 4\nnum_train_steps = 1\n[model]\nkind = \"mlp\"\n{batch}\
             [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"y\"\n\
             [data]\nsynth = {{ kind = \"teacher\", samples = 8 }}\n\
             layout = {{ kind = \"arrays\", feeds = {{ x = \"x\", y = \"y\" }} }}\n\
             [optimizer]\nkind = \"sgd\"\n[lr_schedule]\nkind = \"constant\"\nlr = 0.1\n"
        );
        TrainConfig::parse(&text, Path::new("t.toml")).unwrap()
    }

    #[test]
    fn a_fixed_batch_is_read_off_a_model_file_as_off_a_built_in_model() {
        let dir = std::env::temp_dir().join(format!("pipetrain-fixed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (batch, want) in [("batch = 4\n", Some(4)), ("", None)] {
            let built_in = mlp(batch);
            let found = fixed_batch(&built_in).unwrap();
            assert_eq!(found.as_ref().map(|f| f.1), want, "{batch:?}");
            // The same model as a file.
            let path = dir.join("mlp.onnx");
            crate::onnx::save_model(&built_in.load_model().unwrap(), &path).unwrap();
            let from_file = TrainConfig {
                model: None,
                model_path: path,
                ..built_in
            };
            assert_eq!(fixed_batch(&from_file).unwrap(), found, "{batch:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
