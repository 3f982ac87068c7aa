//! A multi-layer perceptron as a forward ONNX graph: Gemm and ReLU layers, then a Gemm
//! to the class logits. Weights are `[out, in]` (PyTorch's `nn.Linear` layout, applied
//! by Gemm with `transB=1`) and named `fc1.weight`, `fc1.bias`, ... as the peers' MLP.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::builder::{at_least_one, count_params, param_limit, tensor_info, Builder, Dim, Init};
use crate::graph::int_attr;
use crate::onnx::proto::ModelProto;
use crate::tensor::DType;
use crate::Result;

/// An MLP classifier. Defaults: MNIST-sized, 784 -> 512 -> 512 -> 10.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct MlpConfig {
    /// Input features.
    #[arg(long, default_value_t = MlpConfig::DEFAULT_INPUTS)]
    pub inputs: usize,
    /// Widths of the hidden layers, in order (none: a linear model).
    #[arg(long, value_delimiter = ',', default_values_t = MlpConfig::DEFAULT_HIDDEN)]
    pub hidden: Vec<usize>,
    /// Classes.
    #[arg(long, default_value_t = MlpConfig::DEFAULT_CLASSES)]
    pub classes: usize,
    /// A fixed batch size; none: a dynamic batch dimension named `batch`.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl MlpConfig {
    /// Default input features.
    pub const DEFAULT_INPUTS: usize = 784;
    /// Default hidden widths.
    pub const DEFAULT_HIDDEN: [usize; 2] = [512, 512];
    /// Default classes.
    pub const DEFAULT_CLASSES: usize = 10;

    /// Checks every field.
    ///
    /// # Errors
    /// `Config` naming the field (`model.hidden[1]`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        at_least_one(
            path,
            &[
                ("model.inputs", self.inputs),
                ("model.classes", self.classes),
            ],
        )?;
        for (i, &w) in self.hidden.iter().enumerate() {
            let field = format!("model.hidden[{i}]");
            at_least_one(path, &[(field.as_str(), w)])?;
        }
        if let Some(b) = self.batch {
            at_least_one(path, &[("model.batch", b)])?;
        }
        param_limit(path, "model", self.param_count())
    }

    /// Parameters the model holds (`None` when the count overflows).
    pub fn param_count(&self) -> Option<u64> {
        let shapes: Vec<Vec<usize>> = self
            .layers()
            .flat_map(|(i, o)| [vec![o, i], vec![o]])
            .collect();
        let refs: Vec<&[usize]> = shapes.iter().map(Vec::as_slice).collect();
        count_params(&refs)
    }

    /// (inputs, outputs) of each Gemm.
    fn layers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let widths = std::iter::once(self.inputs)
            .chain(self.hidden.iter().copied())
            .chain(std::iter::once(self.classes));
        widths.clone().zip(widths.skip(1))
    }
}

impl Default for MlpConfig {
    fn default() -> Self {
        MlpConfig {
            inputs: MlpConfig::DEFAULT_INPUTS,
            hidden: MlpConfig::DEFAULT_HIDDEN.to_vec(),
            classes: MlpConfig::DEFAULT_CLASSES,
            batch: None,
            seed: 0,
        }
    }
}

/// The model: input `x` float32 [batch, inputs], output `logits` float32 [batch, classes].
/// Initial weights as PyTorch's `nn.Linear`: weight and bias U(-b, b), b = 1/sqrt(in).
pub(crate) fn build(cfg: &MlpConfig) -> Result<ModelProto> {
    let mut b = Builder::new(cfg.seed);
    let layers: Vec<(usize, usize)> = cfg.layers().collect();
    let mut x = "x".to_string();
    for (k, &(inputs, outputs)) in layers.iter().enumerate() {
        let p = format!("fc{}", k + 1);
        let bound = 1.0 / (inputs as f64).sqrt();
        let w = b.weight(
            &format!("{p}.weight"),
            &[outputs, inputs],
            Init::Uniform(bound),
        )?;
        let bias = b.weight(&format!("{p}.bias"), &[outputs], Init::Uniform(bound))?;
        let last = k + 1 == layers.len();
        let name = if last {
            "logits".to_string()
        } else {
            p.clone()
        };
        x = b.op("Gemm", &name, &[&x, &w, &bias], vec![int_attr("transB", 1)]);
        if !last {
            x = b.op("Relu", &format!("{p}.relu"), &[&x], vec![]);
        }
    }
    let batch = Dim::batch(cfg.batch);
    let inputs = vec![tensor_info(
        "x",
        DType::F32,
        &[batch.clone(), Dim::Fixed(cfg.inputs)],
    )];
    let outputs = vec![tensor_info(
        "logits",
        DType::F32,
        &[batch, Dim::Fixed(cfg.classes)],
    )];
    Ok(b.finish("mlp", inputs, outputs))
}
