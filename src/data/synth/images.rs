//! Class-conditional textures: an image task a small convolutional network learns in a
//! few hundred steps.
//!
//! Each class has a texture per channel: the sum of `waves` plane waves
//! `cos(2 pi (fx x + fy y) / size + phase)`, with integer frequencies `fx, fy` in
//! [-3, 3] (not both 0) and random phases, drawn once. A sample of class `c` is class
//! `c`'s texture circularly shifted by up to `max_shift` pixels on each axis, plus
//! Gaussian noise of standard deviation `noise`. Integer frequencies make the shift a
//! phase change, so what tells the classes apart is which frequencies and orientations
//! each channel holds, wherever the pattern starts. Labels cycle through the classes
//! (row `i` is class `i % classes`), so every run of `classes` rows is balanced.

use std::path::Path;

use rand::Rng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};

use super::{elements_limit, sample_rng, task_rng};
use crate::models::{at_least_one, rule};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The highest frequency of a texture, in cycles across the image.
const MAX_FREQ: i64 = 3;

/// The image task: arrays `x` float32 [samples, channels, size, size], `y` int64 [samples].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct ImagesConfig {
    /// Images.
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.samples)]
    pub samples: usize,
    /// Classes.
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.classes)]
    pub classes: usize,
    /// Channels.
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.channels)]
    pub channels: usize,
    /// Height and width.
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.image_size)]
    pub image_size: usize,
    /// Plane waves per class and channel.
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.waves)]
    pub waves: usize,
    /// The largest circular shift, in pixels, on each axis.
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.max_shift)]
    pub max_shift: usize,
    /// Standard deviation of the added Gaussian noise (a texture's is about 1).
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.noise)]
    pub noise: f32,
    /// Seed of the task (the textures).
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.seed)]
    pub seed: u64,
    /// Seed of the samples drawn from the task (the shifts and noise): another value gives held-out
    /// data of the same task.
    #[arg(long, default_value_t = ImagesConfig::DEFAULT.sample_seed)]
    pub sample_seed: u64,
}

impl ImagesConfig {
    /// The defaults, as a constant (the command line's defaults too): SqueezeNet's
    /// default input and classes.
    pub const DEFAULT: ImagesConfig = ImagesConfig {
        samples: 1024,
        classes: 10,
        channels: 3,
        image_size: 32,
        waves: 2,
        max_shift: 4,
        noise: 0.5,
        seed: 0,
        sample_seed: 0,
    };

    /// Checks every field.
    ///
    /// # Errors
    /// `Config` naming the field (`synth.noise`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        at_least_one(
            path,
            &[
                ("synth.samples", self.samples),
                ("synth.classes", self.classes),
                ("synth.channels", self.channels),
                ("synth.image_size", self.image_size),
                ("synth.waves", self.waves),
            ],
        )?;
        rule(
            self.noise.is_finite() && self.noise >= 0.0,
            path,
            "synth.noise",
            format!("must be a finite number >= 0 (got {})", self.noise),
        )?;
        rule(
            i64::try_from(self.classes).is_ok(),
            path,
            "synth.classes",
            "must fit int64",
        )?;
        elements_limit(
            path,
            "synth.samples",
            &[
                self.samples,
                self.channels,
                self.image_size,
                self.image_size,
            ],
        )?;
        // The textures: classes x channels images.
        elements_limit(
            path,
            "synth.classes",
            &[
                self.classes,
                self.channels,
                self.image_size,
                self.image_size,
            ],
        )
    }

    /// `x` and `y` (the configuration must be valid).
    pub(super) fn generate(&self) -> Result<(Tensor, Tensor)> {
        let mut rng = task_rng(self.seed);
        let mut draw = sample_rng(self.seed, self.sample_seed);
        let (c, s) = (self.channels, self.image_size);
        let plane = s * s;
        // textures[(class * c + channel) * plane + y * s + x], each of variance ~1.
        let amp = (2.0 / self.waves as f64).sqrt();
        let mut textures = vec![0f32; self.classes * c * plane];
        for tex in textures.chunks_mut(plane) {
            for _ in 0..self.waves {
                let (fx, fy) = loop {
                    let f = (
                        rng.random_range(-MAX_FREQ..=MAX_FREQ),
                        rng.random_range(-MAX_FREQ..=MAX_FREQ),
                    );
                    if f != (0, 0) {
                        break f;
                    }
                };
                let phase = rng.random_range(0.0..std::f64::consts::TAU);
                let k = std::f64::consts::TAU / s as f64;
                for (i, v) in tex.iter_mut().enumerate() {
                    let (y, x) = ((i / s) as f64, (i % s) as f64);
                    *v += (amp * (k * (fx as f64 * x + fy as f64 * y) + phase).cos()) as f32;
                }
            }
        }
        let noise = Normal::new(0.0, f64::from(self.noise)).map_err(|e| Error::BadTensor {
            name: "x".into(),
            reason: format!("noise: {e}"),
        })?;
        let shift = self.max_shift.min(s) as i64;
        let mut x = Vec::with_capacity(self.samples * c * plane);
        let mut y = Vec::with_capacity(self.samples);
        for i in 0..self.samples {
            let class = i % self.classes;
            let dy = draw.random_range(-shift..=shift);
            let dx = draw.random_range(-shift..=shift);
            for tex in textures[class * c * plane..(class + 1) * c * plane].chunks(plane) {
                for row in 0..s as i64 {
                    let from_row = (row - dy).rem_euclid(s as i64) as usize * s;
                    for col in 0..s as i64 {
                        let from = from_row + (col - dx).rem_euclid(s as i64) as usize;
                        x.push(tex[from] + noise.sample(&mut draw) as f32);
                    }
                }
            }
            y.push(class as i64);
        }
        Ok((
            Tensor::f32(vec![self.samples, c, s, s], x)?,
            Tensor::i64(vec![self.samples], y)?,
        ))
    }
}

impl Default for ImagesConfig {
    fn default() -> Self {
        ImagesConfig::DEFAULT
    }
}
