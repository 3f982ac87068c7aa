//! Gaussian inputs labelled by a fixed random teacher network, as the peers' MLP data:
//! `y = argmax(tanh(2 x W1 + b1) W2 - m)`, with `W1` ~ N(0, 1/inputs), `b1` ~ N(0, 0.01),
//! `W2` ~ N(0, 1/hidden), and `m` the logits' mean over the samples (which balances the
//! classes). A student of at least the teacher's size can fit the labels exactly.

use std::path::Path;

use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use super::{elements_limit, sample_rng, task_rng};
use crate::models::{at_least_one, rule};
use crate::tensor::Tensor;
use crate::Result;

/// The teacher task: arrays `x` float32 [samples, inputs], `y` int64 [samples].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct TeacherConfig {
    /// Samples.
    #[arg(long, default_value_t = TeacherConfig::DEFAULT.samples)]
    pub samples: usize,
    /// Input features.
    #[arg(long, default_value_t = TeacherConfig::DEFAULT.inputs)]
    pub inputs: usize,
    /// Classes.
    #[arg(long, default_value_t = TeacherConfig::DEFAULT.classes)]
    pub classes: usize,
    /// The teacher's hidden width.
    #[arg(long, default_value_t = TeacherConfig::DEFAULT.hidden)]
    pub hidden: usize,
    /// Seed of the task (the teacher).
    #[arg(long, default_value_t = TeacherConfig::DEFAULT.seed)]
    pub seed: u64,
    /// Seed of the samples drawn from the task (the inputs): another value gives held-out
    /// data of the same task.
    #[arg(long, default_value_t = TeacherConfig::DEFAULT.sample_seed)]
    pub sample_seed: u64,
}

impl TeacherConfig {
    /// The defaults, as a constant (the command line's defaults too): the MLP's default
    /// input and classes, the peers' teacher width.
    pub const DEFAULT: TeacherConfig = TeacherConfig {
        samples: 4096,
        inputs: 784,
        classes: 10,
        hidden: 64,
        seed: 0,
        sample_seed: 0,
    };

    /// Checks every field.
    ///
    /// # Errors
    /// `Config` naming the field (`synth.inputs`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        at_least_one(
            path,
            &[
                ("synth.samples", self.samples),
                ("synth.inputs", self.inputs),
                ("synth.classes", self.classes),
                ("synth.hidden", self.hidden),
            ],
        )?;
        rule(
            i64::try_from(self.classes).is_ok(),
            path,
            "synth.classes",
            "must fit int64",
        )?;
        elements_limit(path, "synth.samples", &[self.samples, self.inputs])?;
        elements_limit(path, "synth.samples", &[self.samples, self.classes])?;
        elements_limit(path, "synth.hidden", &[self.hidden, self.inputs])?;
        elements_limit(path, "synth.hidden", &[self.hidden, self.classes])
    }

    /// `x` and `y` (the configuration must be valid).
    pub(super) fn generate(&self) -> Result<(Tensor, Tensor)> {
        let mut rng = task_rng(self.seed);
        let mut draw = sample_rng(self.seed, self.sample_seed);
        let (n, d, h, c) = (self.samples, self.inputs, self.hidden, self.classes);
        let normal = |rng: &mut ChaCha8Rng, count: usize, std: f64| -> Vec<f64> {
            (0..count)
                .map(|_| std * Distribution::<f64>::sample(&StandardNormal, rng))
                .collect()
        };
        let w1 = normal(&mut rng, d * h, 1.0 / (d as f64).sqrt());
        let b1 = normal(&mut rng, h, 0.1);
        let w2 = normal(&mut rng, h * c, 1.0 / (h as f64).sqrt());
        // Inputs rounded to float32 first, so the labels are those of the stored x.
        let x: Vec<f32> = normal(&mut draw, n * d, 1.0)
            .into_iter()
            .map(|v| v as f32)
            .collect();

        let mut logits = vec![0f64; n * c];
        let mut hid = vec![0f64; h];
        for (row, out) in x.chunks(d).zip(logits.chunks_mut(c)) {
            hid.copy_from_slice(&b1);
            for (i, &xi) in row.iter().enumerate() {
                let xi = 2.0 * f64::from(xi);
                for (a, w) in hid.iter_mut().zip(&w1[i * h..(i + 1) * h]) {
                    *a += xi * w;
                }
            }
            for (j, a) in hid.iter().enumerate() {
                let t = a.tanh();
                for (o, w) in out.iter_mut().zip(&w2[j * c..(j + 1) * c]) {
                    *o += t * w;
                }
            }
        }
        let mut mean = vec![0f64; c];
        for out in logits.chunks(c) {
            for (m, o) in mean.iter_mut().zip(out) {
                *m += o / n as f64;
            }
        }
        let y: Vec<i64> = logits
            .chunks(c)
            .map(|out| {
                let centred = out.iter().zip(&mean).map(|(o, m)| o - m);
                let best = centred
                    .enumerate()
                    .fold(
                        (0, f64::NEG_INFINITY),
                        |b, (k, v)| if v > b.1 { (k, v) } else { b },
                    );
                best.0 as i64
            })
            .collect();
        Ok((Tensor::f32(vec![n, d], x)?, Tensor::i64(vec![n], y)?))
    }
}

impl Default for TeacherConfig {
    fn default() -> Self {
        TeacherConfig::DEFAULT
    }
}
