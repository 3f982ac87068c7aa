//! Built-in forward models, written as ONNX from Rust: GPT-2, SqueezeNet 1.1 and an MLP.
//!
//! Each is a standard forward model (opset 17, IR version 8) with its initial weights in
//! its initializers, drawn from a seed, and built only from operators pipetrain
//! differentiates, so `pipetrain train` trains it as it is; untrained constants (shapes,
//! the causal mask) are `Constant` nodes, since pipetrain trains every float initializer.
//! With `batch` unset the batch dimension is symbolic (`batch`) and every reshape keeps
//! it so, so pipeline micro-batches of any size run.
//!
//! # Layout
//! - `builder`: the shared node, weight and constant builder.
//! - `gpt2`, `squeezenet`, `mlp`: one model each, with its configuration.
//! - `cli`: `pipetrain model gpt2|squeezenet|mlp ... -o model.onnx`.

mod builder;
mod cli;
mod gpt2;
mod mlp;
mod squeezenet;

use std::path::Path;

use serde::{Deserialize, Serialize};

pub(crate) use builder::{at_least_one, rule};
pub use builder::{BATCH_DIM, IR_VERSION, MAX_PARAMS, OPSET};
pub use cli::{model_command, ModelArgs, ModelCommand};
pub use gpt2::Gpt2Config;
pub use mlp::MlpConfig;
pub use squeezenet::{SqueezeNetConfig, MIN_IMAGE_SIZE};

use crate::onnx::proto::ModelProto;
use crate::Result;

/// Which model to build, and its configuration (a TOML table with `kind = "gpt2"`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelSpec {
    /// GPT-2 language model.
    Gpt2(Gpt2Config),
    /// SqueezeNet 1.1 image classifier.
    Squeezenet(SqueezeNetConfig),
    /// Multi-layer perceptron classifier.
    Mlp(MlpConfig),
}

impl ModelSpec {
    /// Checks the configuration; `path` names the file in errors.
    ///
    /// # Errors
    /// `Config` naming the field (`model.heads`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        match self {
            ModelSpec::Gpt2(c) => c.validate(path),
            ModelSpec::Squeezenet(c) => c.validate(path),
            ModelSpec::Mlp(c) => c.validate(path),
        }
    }

    /// The kind's name, as in `kind = "..."`.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelSpec::Gpt2(_) => "gpt2",
            ModelSpec::Squeezenet(_) => "squeezenet",
            ModelSpec::Mlp(_) => "mlp",
        }
    }

    /// Parameters the model holds (`None` when the count overflows).
    pub fn param_count(&self) -> Option<u64> {
        match self {
            ModelSpec::Gpt2(c) => c.param_count(),
            ModelSpec::Squeezenet(c) => c.param_count(),
            ModelSpec::Mlp(c) => c.param_count(),
        }
    }
}

/// Builds the forward model, after checking the configuration.
///
/// # Errors
/// `Config` as [`ModelSpec::validate`] (the file named `<model>`).
pub fn build(spec: &ModelSpec) -> Result<ModelProto> {
    spec.validate(Path::new("<model>"))?;
    match spec {
        ModelSpec::Gpt2(c) => gpt2::build(c),
        ModelSpec::Squeezenet(c) => squeezenet::build(c),
        ModelSpec::Mlp(c) => mlp::build(c),
    }
}

/// Elements in a model's initializers.
pub fn initializer_elements(model: &ModelProto) -> u64 {
    model.graph.as_ref().map_or(0, |g| {
        g.initializer
            .iter()
            .map(|t| t.dims.iter().map(|&d| d.max(0) as u64).product::<u64>())
            .sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    fn field_of(spec: &ModelSpec) -> String {
        match spec.validate(Path::new("m.toml")) {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a Config error, got {other:?}"),
        }
    }

    #[test]
    fn every_field_has_a_default_and_unknown_fields_are_refused() {
        let spec: ModelSpec = toml::from_str("kind = \"gpt2\"").unwrap();
        assert_eq!(spec, ModelSpec::Gpt2(Gpt2Config::default()));
        let spec: ModelSpec = toml::from_str("kind = \"mlp\"\nhidden = [8]").unwrap();
        assert_eq!(
            spec,
            ModelSpec::Mlp(MlpConfig {
                hidden: vec![8],
                ..Default::default()
            })
        );
        assert!(toml::from_str::<ModelSpec>("kind = \"squeezenet\"\nlayers = 2").is_err());
        assert!(toml::from_str::<ModelSpec>("kind = \"resnet\"").is_err());
        // What is written reads back the same.
        for spec in [
            ModelSpec::Gpt2(Gpt2Config::default()),
            ModelSpec::Squeezenet(SqueezeNetConfig {
                batch: Some(8),
                ..Default::default()
            }),
            ModelSpec::Mlp(MlpConfig::default()),
        ] {
            let text = toml::to_string(&spec).unwrap();
            assert_eq!(toml::from_str::<ModelSpec>(&text).unwrap(), spec, "{text}");
        }
    }

    #[test]
    fn parameter_counts_match_the_built_initializers() {
        let specs = [
            ModelSpec::Gpt2(Gpt2Config::default()),
            ModelSpec::Gpt2(Gpt2Config {
                tie_embeddings: true,
                ..Default::default()
            }),
            ModelSpec::Squeezenet(SqueezeNetConfig::default()),
            ModelSpec::Mlp(MlpConfig::default()),
        ];
        for spec in &specs {
            let model = build(spec).unwrap();
            assert_eq!(
                spec.param_count(),
                Some(initializer_elements(&model)),
                "{spec:?}"
            );
        }
        // torchvision's squeezenet1_1 has 1,235,496 parameters with 1000 classes.
        let imagenet = SqueezeNetConfig {
            classes: 1000,
            image_size: 224,
            ..Default::default()
        };
        assert_eq!(imagenet.param_count(), Some(1_235_496));
    }

    #[test]
    fn the_same_seed_gives_the_same_weights() {
        let a = build(&ModelSpec::Mlp(MlpConfig::default())).unwrap();
        let b = build(&ModelSpec::Mlp(MlpConfig::default())).unwrap();
        let c = build(&ModelSpec::Mlp(MlpConfig {
            seed: 1,
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(a, b);
        assert_ne!(a.graph.unwrap().initializer, c.graph.unwrap().initializer);
    }

    #[test]
    fn bad_sizes_name_their_field() {
        let gpt = |f: fn(&mut Gpt2Config)| {
            let mut c = Gpt2Config::default();
            f(&mut c);
            field_of(&ModelSpec::Gpt2(c))
        };
        assert_eq!(gpt(|c| c.heads = 3), "model.heads");
        assert_eq!(gpt(|c| c.heads = 0), "model.heads");
        assert_eq!(gpt(|c| c.layers = 0), "model.layers");
        assert_eq!(gpt(|c| c.batch = Some(0)), "model.batch");
        assert_eq!(gpt(|c| c.vocab = usize::MAX), "model");
        let sq = |f: fn(&mut SqueezeNetConfig)| {
            let mut c = SqueezeNetConfig::default();
            f(&mut c);
            field_of(&ModelSpec::Squeezenet(c))
        };
        assert_eq!(sq(|c| c.image_size = 30), "model.image_size");
        assert_eq!(sq(|c| c.dropout = 1.0), "model.dropout");
        assert_eq!(sq(|c| c.dropout = f32::NAN), "model.dropout");
        assert_eq!(sq(|c| c.classes = 0), "model.classes");
        let mlp = MlpConfig {
            hidden: vec![4, 0],
            ..Default::default()
        };
        assert_eq!(field_of(&ModelSpec::Mlp(mlp)), "model.hidden[1]");
        assert!(matches!(
            build(&ModelSpec::Mlp(MlpConfig {
                inputs: 0,
                ..Default::default()
            })),
            Err(Error::Config { .. })
        ));
    }
}
