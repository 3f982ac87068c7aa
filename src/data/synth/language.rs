//! A sparse Markov chain over tokens: a language whose rules a small GPT-2 finds in a
//! few dozen optimizer steps, with an entropy floor known in closed form.
//!
//! Each context (the previous `order` tokens) allows `branching` distinct next tokens,
//! drawn once from the vocabulary, each equally likely. The first `order` tokens of a
//! row are uniform. So a model that knows the rules predicts a token with a full
//! context at cross-entropy `ln(branching)`, and one with a shorter context (the first
//! `order - 1` targets of a row) at best at `ln(vocab)`: [`LanguageConfig::entropy_floor`].

use std::path::Path;

use rand::seq::index::sample;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::{elements_limit, sample_rng, task_rng, MAX_CONTEXTS};
use crate::models::rule;
use crate::tensor::Tensor;
use crate::Result;

/// The language task: array `tokens` int64 [samples, seq + 1].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct LanguageConfig {
    /// Rows (sequences).
    #[arg(long, default_value_t = LanguageConfig::DEFAULT.samples)]
    pub samples: usize,
    /// Context length T of the model: rows hold T + 1 tokens (input and shifted target).
    #[arg(long, default_value_t = LanguageConfig::DEFAULT.seq)]
    pub seq: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = LanguageConfig::DEFAULT.vocab)]
    pub vocab: usize,
    /// Tokens of context that decide the next token's choices.
    #[arg(long, default_value_t = LanguageConfig::DEFAULT.order)]
    pub order: usize,
    /// Allowed next tokens per context (at most `vocab`).
    #[arg(long, default_value_t = LanguageConfig::DEFAULT.branching)]
    pub branching: usize,
    /// Seed of the task (the rules).
    #[arg(long, default_value_t = LanguageConfig::DEFAULT.seed)]
    pub seed: u64,
    /// Seed of the samples drawn from the task (the rows): another value gives held-out
    /// data of the same task.
    #[arg(long, default_value_t = LanguageConfig::DEFAULT.sample_seed)]
    pub sample_seed: u64,
}

impl LanguageConfig {
    /// The defaults, as a constant (the command line's defaults too): a bigram chain of
    /// 64 tokens, 4 choices each, matching GPT-2's default vocabulary and context.
    pub const DEFAULT: LanguageConfig = LanguageConfig {
        samples: 512,
        seq: 32,
        vocab: 64,
        order: 1,
        branching: 4,
        seed: 0,
        sample_seed: 0,
    };

    /// Checks every field.
    ///
    /// # Errors
    /// `Config` naming the field (`synth.branching`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        crate::models::at_least_one(
            path,
            &[
                ("synth.samples", self.samples),
                ("synth.seq", self.seq),
                ("synth.vocab", self.vocab),
                ("synth.order", self.order),
                ("synth.branching", self.branching),
            ],
        )?;
        rule(
            self.branching <= self.vocab,
            path,
            "synth.branching",
            format!(
                "must be at most synth.vocab ({} > {})",
                self.branching, self.vocab
            ),
        )?;
        rule(
            self.order <= self.seq,
            path,
            "synth.order",
            format!("must be at most synth.seq ({} > {})", self.order, self.seq),
        )?;
        rule(
            i64::try_from(self.vocab).is_ok(),
            path,
            "synth.vocab",
            "must fit int64",
        )?;
        let contexts = contexts(self.vocab, self.order);
        rule(
            contexts.is_some_and(|c| c.saturating_mul(self.branching) <= MAX_CONTEXTS),
            path,
            "synth.order",
            format!(
                "vocab^order x branching rules must be at most {MAX_CONTEXTS} \
                 (vocab {}, order {}, branching {})",
                self.vocab, self.order, self.branching
            ),
        )?;
        elements_limit(
            path,
            "synth.samples",
            &[self.samples, self.seq.saturating_add(1)],
        )
    }

    /// The lowest mean cross-entropy (nats per target token) a model can reach on this
    /// data: `ln(branching)` for targets with a full context, `ln(vocab)` for the first
    /// `order - 1` targets of a row, which follow uniform tokens.
    pub fn entropy_floor(&self) -> f64 {
        let t = self.seq as f64;
        let short = self.order.saturating_sub(1) as f64;
        (short * (self.vocab as f64).ln() + (t - short) * (self.branching as f64).ln()) / t
    }

    /// The token rows (the configuration must be valid).
    pub(super) fn generate(&self) -> Result<Tensor> {
        let mut rng = task_rng(self.seed);
        let mut draw = sample_rng(self.seed, self.sample_seed);
        let (v, k) = (self.vocab, self.branching);
        let n_contexts = contexts(v, self.order).unwrap_or(0);
        // rules[c * k + j]: the j-th allowed successor of context c.
        let mut rules = Vec::with_capacity(n_contexts * k);
        for _ in 0..n_contexts {
            rules.extend(sample(&mut rng, v, k));
        }
        let width = self.seq + 1;
        let mut tokens = Vec::with_capacity(self.samples * width);
        for _ in 0..self.samples {
            let row_start = tokens.len();
            for pos in 0..width {
                let next = if pos < self.order {
                    draw.random_range(0..v)
                } else {
                    // The context as a base-`vocab` number of the last `order` tokens.
                    let ctx = tokens[row_start + pos - self.order..row_start + pos]
                        .iter()
                        .fold(0usize, |c, &t| c * v + t as usize);
                    rules[ctx * k + draw.random_range(0..k)]
                };
                tokens.push(next as i64);
            }
        }
        Tensor::i64(vec![self.samples, width], tokens)
    }
}

impl Default for LanguageConfig {
    fn default() -> Self {
        LanguageConfig::DEFAULT
    }
}

/// `vocab^order`, when it fits.
fn contexts(vocab: usize, order: usize) -> Option<usize> {
    u32::try_from(order).ok().and_then(|o| vocab.checked_pow(o))
}
