//! SqueezeNet 1.1 (Iandola et al. 2016; torchvision's `squeezenet1_1`) as a forward ONNX
//! graph: a 3x3/2 convolution, fire modules (a 1x1 squeeze, then 1x1 and 3x3 expands
//! concatenated) with 3x3/2 max-pools between groups, and a classifier of Dropout, a 1x1
//! convolution to the classes, ReLU and a global average pool.
//!
//! Differences from torchvision, and why:
//! - The max-pools use floor mode (`ceil_mode=0`) where torchvision uses ceil mode:
//!   pipetrain's MaxPool gradient handles ceil mode only where it adds no partial
//!   window. At 32x32 (and 224x224) every pool's input has an odd size, so both modes
//!   give the same windows and the same outputs; at other sizes floor mode drops the
//!   partial window at the edge that ceil mode would keep.
//! - Dropout is written as in an eval-mode export (no `training_mode` input), so it is
//!   an identity in inference and also under pipetrain's training, which trains the
//!   forward graph as written and has no train/eval switch. A Dropout in training mode
//!   would stay on in the exported inference model.
//!
//! Weight names follow torchvision's (`features.3.squeeze.weight`, `classifier.1.weight`)
//! so its weights can be loaded by name.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::builder::{
    at_least_one, count_params, param_limit, rule, tensor_info, Builder, Dim, Init,
};
use crate::graph::{int_attr, ints_attr};
use crate::onnx::proto::ModelProto;
use crate::tensor::DType;
use crate::Result;

/// The smallest image side the stem and the three 3x3/2 pools fit: the stem gives
/// `(s - 3) / 2 + 1`, and the third pool needs at least 3x3 (so the first one 15x15).
pub const MIN_IMAGE_SIZE: usize = 31;

/// The fire modules of SqueezeNet 1.1 in order: (squeeze, expand 1x1, expand 3x3)
/// channels, with `true` where a max-pool comes before the module.
const FIRES: [(usize, usize, usize, bool); 8] = [
    (16, 64, 64, true),
    (16, 64, 64, false),
    (32, 128, 128, true),
    (32, 128, 128, false),
    (48, 192, 192, true),
    (48, 192, 192, false),
    (64, 256, 256, false),
    (64, 256, 256, false),
];

/// Output channels of the stem convolution.
const STEM: usize = 64;

/// A SqueezeNet 1.1 image classifier. Defaults: CIFAR-sized 32x32 RGB images, 10 classes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct SqueezeNetConfig {
    /// Image height and width.
    #[arg(long, default_value_t = SqueezeNetConfig::DEFAULT.image_size)]
    pub image_size: usize,
    /// Image channels.
    #[arg(long, default_value_t = SqueezeNetConfig::DEFAULT.channels)]
    pub channels: usize,
    /// Classes.
    #[arg(long, default_value_t = SqueezeNetConfig::DEFAULT.classes)]
    pub classes: usize,
    /// The classifier's Dropout ratio (in [0, 1); an identity under training, see the
    /// module docs).
    #[arg(long, default_value_t = SqueezeNetConfig::DEFAULT.dropout)]
    pub dropout: f32,
    /// A fixed batch size; none: a dynamic batch dimension named `batch`.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = SqueezeNetConfig::DEFAULT.seed)]
    pub seed: u64,
}

impl SqueezeNetConfig {
    /// The defaults, as a constant (the command line's defaults too).
    pub const DEFAULT: SqueezeNetConfig = SqueezeNetConfig {
        image_size: 32,
        channels: 3,
        classes: 10,
        dropout: 0.5,
        batch: None,
        seed: 0,
    };

    /// Checks every field.
    ///
    /// # Errors
    /// `Config` naming the field (`model.image_size`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        at_least_one(
            path,
            &[
                ("model.channels", self.channels),
                ("model.classes", self.classes),
            ],
        )?;
        rule(
            self.image_size >= MIN_IMAGE_SIZE,
            path,
            "model.image_size",
            format!(
                "must be at least {MIN_IMAGE_SIZE}: the 3x3/2 stem and three 3x3/2 max-pools \
                 need it (got {})",
                self.image_size
            ),
        )?;
        rule(
            (0.0..1.0).contains(&self.dropout),
            path,
            "model.dropout",
            format!("must be in [0, 1) (got {})", self.dropout),
        )?;
        if let Some(b) = self.batch {
            at_least_one(path, &[("model.batch", b)])?;
        }
        param_limit(path, "model", self.param_count())
    }

    /// Parameters the model holds (`None` when the count overflows).
    pub fn param_count(&self) -> Option<u64> {
        let mut shapes: Vec<Vec<usize>> = vec![vec![STEM, self.channels, 3, 3], vec![STEM]];
        let mut inputs = STEM;
        for &(s, e1, e3, _) in &FIRES {
            shapes.extend([
                vec![s, inputs],
                vec![s],
                vec![e1, s],
                vec![e1],
                vec![e3, s, 9],
                vec![e3],
            ]);
            inputs = e1 + e3;
        }
        shapes.extend([vec![self.classes, inputs], vec![self.classes]]);
        let refs: Vec<&[usize]> = shapes.iter().map(Vec::as_slice).collect();
        count_params(&refs)
    }
}

impl Default for SqueezeNetConfig {
    fn default() -> Self {
        SqueezeNetConfig::DEFAULT
    }
}

/// The model: input `x` float32 [batch, channels, size, size], output `logits` float32
/// [batch, classes]. Initial weights as torchvision's: Kaiming-uniform convolutions
/// (U(-b, b), b = sqrt(6 / fan_in)), the final one N(0, 0.01^2), biases 0.
pub(crate) fn build(cfg: &SqueezeNetConfig) -> Result<ModelProto> {
    let mut b = Builder::new(cfg.seed);
    let x = conv(&mut b, "x", "features.0", cfg.channels, STEM, 3, 2, None)?;
    let mut x = b.op("Relu", "features.1", &[&x], vec![]);
    let mut inputs = STEM;
    // torchvision's `features` indices: conv 0, relu 1, pool 2, then fires and pools.
    let mut index = 2;
    for &(s, e1, e3, pool_before) in &FIRES {
        if pool_before {
            x = max_pool(&mut b, &x, &format!("features.{index}"));
            index += 1;
        }
        x = fire(&mut b, &x, &format!("features.{index}"), inputs, s, e1, e3)?;
        inputs = e1 + e3;
        index += 1;
    }
    let ratio = b.scalar("classifier.0.ratio", cfg.dropout);
    let x = b.op("Dropout", "classifier.0", &[&x, &ratio], vec![]);
    let final_init = Init::Normal(0.01);
    let x = conv(
        &mut b,
        &x,
        "classifier.1",
        inputs,
        cfg.classes,
        1,
        1,
        Some(final_init),
    )?;
    let x = b.op("Relu", "classifier.2", &[&x], vec![]);
    let x = b.op("GlobalAveragePool", "classifier.3", &[&x], vec![]);
    let flat = b.ints("flatten_shape", &[0, -1]);
    b.op("Reshape", "logits", &[&x, &flat], vec![]);

    let batch = Dim::batch(cfg.batch);
    let side = Dim::Fixed(cfg.image_size);
    let inputs = vec![tensor_info(
        "x",
        DType::F32,
        &[batch.clone(), Dim::Fixed(cfg.channels), side.clone(), side],
    )];
    let outputs = vec![tensor_info(
        "logits",
        DType::F32,
        &[batch, Dim::Fixed(cfg.classes)],
    )];
    Ok(b.finish("squeezenet1_1", inputs, outputs))
}

/// A fire module: squeeze 1x1 + ReLU, then expand 1x1 + ReLU and expand 3x3 (pad 1) +
/// ReLU, concatenated on channels.
fn fire(
    b: &mut Builder,
    x: &str,
    p: &str,
    inputs: usize,
    squeeze: usize,
    e1: usize,
    e3: usize,
) -> Result<String> {
    let s = conv(b, x, &format!("{p}.squeeze"), inputs, squeeze, 1, 1, None)?;
    let s = b.op("Relu", &format!("{p}.squeeze_activation"), &[&s], vec![]);
    let a = conv(b, &s, &format!("{p}.expand1x1"), squeeze, e1, 1, 1, None)?;
    let a = b.op("Relu", &format!("{p}.expand1x1_activation"), &[&a], vec![]);
    let c = conv(b, &s, &format!("{p}.expand3x3"), squeeze, e3, 3, 1, None)?;
    let c = b.op("Relu", &format!("{p}.expand3x3_activation"), &[&c], vec![]);
    Ok(b.op("Concat", p, &[&a, &c], vec![int_attr("axis", 1)]))
}

/// A 3x3/2 max-pool in floor mode (see the module docs).
fn max_pool(b: &mut Builder, x: &str, name: &str) -> String {
    b.op(
        "MaxPool",
        name,
        &[x],
        vec![
            ints_attr("kernel_shape", &[3, 3]),
            ints_attr("strides", &[2, 2]),
        ],
    )
}

/// A square convolution with bias; padded to keep the size when `kernel` is 3 and
/// `stride` 1 (the fire expands). `init` defaults to Kaiming-uniform.
#[allow(clippy::too_many_arguments)]
fn conv(
    b: &mut Builder,
    x: &str,
    p: &str,
    inputs: usize,
    outputs: usize,
    kernel: usize,
    stride: usize,
    init: Option<Init>,
) -> Result<String> {
    let fan_in = (inputs * kernel * kernel) as f64;
    let init = init.unwrap_or(Init::Uniform((6.0 / fan_in).sqrt()));
    let w = b.weight(
        &format!("{p}.weight"),
        &[outputs, inputs, kernel, kernel],
        init,
    )?;
    let bias = b.weight(&format!("{p}.bias"), &[outputs], Init::Const(0.0))?;
    let pad = if kernel == 3 && stride == 1 { 1 } else { 0 };
    let k = kernel as i64;
    let s = stride as i64;
    Ok(b.op(
        "Conv",
        p,
        &[x, &w, &bias],
        vec![
            ints_attr("kernel_shape", &[k, k]),
            ints_attr("strides", &[s, s]),
            ints_attr("pads", &[pad, pad, pad, pad]),
        ],
    ))
}
