//! Tensor parallelism (`horizontal_parallel_size`) on the built-in GPT-2 (4 layers,
//! d 256, 8 heads, seq 64, vocab 256; micro-batches of 4, 2 per step, AdamW), at hp 1,
//! 2 and 4 in one process, in alternating rounds:
//! - parameters and AdamW state each rank holds, against hp 1 (the split layers' share
//!   falls as 1/hp; embeddings, LayerNorms, the head and the row-parallel biases stay);
//! - bytes each shard brings to the tensor-parallel all-reduces per step, measured by
//!   the collectives, against Megatron-LM's count (two all-reduces of b x s x h per layer
//!   forward and two backward, per micro-batch);
//! - the share of the step shard 0 spends in those all-reduces (waiting included), and
//!   steps/s against hp 1. On 2 cores every shard shares the same cores, so no speed-up
//!   can show: the ratios say what the split costs, not what it gains.
//!
//! `cargo bench --bench tensor_parallel`.

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::path::Path;

use pipetrain::config::TrainConfig;
use pipetrain::graph::{build_sharded_training_graph, TrainOptions};
use pipetrain::tensor::Tensor;
use pipetrain::train::train;

const ROUNDS: usize = 5;
const STEPS: usize = 20;
const LAYERS: usize = 4;
const D: usize = 256;
const SEQ: usize = 64;
const BATCH: usize = 4;
const MICRO: usize = 2;

fn config(dir: &Path, hp: usize) -> (TrainConfig, std::path::PathBuf) {
    let text = format!(
        "batch_size = {BATCH}\ngradient_accumulation_steps = {MICRO}\n\
         num_train_steps = {}\nhorizontal_parallel_size = {hp}\ndisplay_loss_steps = 1000\n\
         [model]\nkind = \"gpt2\"\nlayers = {LAYERS}\nd_model = {D}\nheads = 8\nvocab = 256\nseq = {SEQ}\n\
         [loss]\nkind = \"softmax_cross_entropy\"\nprediction = \"logits\"\nlabel = \"targets\"\n\
         [data]\nsynth = {{ kind = \"language\", samples = 2048, seq = {SEQ}, vocab = 256, seed = 7 }}\n\
         layout = {{ kind = \"next_token\", array = \"tokens\", input = \"tokens\", label = \"targets\" }}\n\
         [optimizer]\nkind = \"adamw\"\n[lr_schedule]\nkind = \"constant\"\nlr = 1e-3\n",
        STEPS * MICRO
    );
    let path = dir.join(format!("hp{hp}.toml"));
    std::fs::write(&path, text).unwrap();
    (TrainConfig::load(&path).unwrap(), path)
}

/// Values of parameters each rank holds at `hp`: (all, in split layers).
fn held(cfg: &TrainConfig, hp: usize) -> (usize, usize) {
    let model = cfg.load_model().unwrap();
    let tokens = Tensor::i64(vec![BATCH, SEQ], vec![1; BATCH * SEQ]).unwrap();
    let example = [("tokens", &tokens), ("targets", &tokens)];
    let opts = TrainOptions {
        inputs: Default::default(),
        loss: cfg.loss.clone(),
        trainable: None,
        contrib_ops: true,
        fused_kernels: true,
        cuda_kernels: false,
        cuda_kernels_untried: false,
        flash_attention: false,
        params: cfg.params.clone(),
    };
    let tg = build_sharded_training_graph(&common::runtime(), &model, &opts, &example, hp).unwrap();
    let split: usize = tg
        .params
        .iter()
        .filter(|p| {
            tg.shards
                .as_ref()
                .is_some_and(|s| s.specs.contains_key(&p.name))
        })
        .map(|p| p.meta.numel())
        .sum();
    (tg.params.iter().map(|p| p.meta.numel()).sum(), split)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = [1, 2, 4];
    let rt = common::runtime();
    let configs: Vec<_> = sizes.iter().map(|&hp| config(dir.path(), hp)).collect();
    let mut rates = vec![Vec::new(); sizes.len()];
    let mut shares = vec![Vec::new(); sizes.len()];
    let mut bytes = vec![0u64; sizes.len()];
    for _ in 0..ROUNDS {
        for (i, (cfg, path)) in configs.iter().enumerate() {
            let s = train(&rt, cfg, path, false, |_| {}).unwrap();
            rates[i].push(s.steps as f64 / s.elapsed.as_secs_f64());
            if let Some(t) = s.shard_traffic {
                shares[i].push(t.seconds / s.elapsed.as_secs_f64());
                bytes[i] = t.bytes / s.steps as u64;
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let megatron = (4 * LAYERS * BATCH * SEQ * D * MICRO * 4) as u64;
    let (whole, _) = held(&configs[0].0, 1);
    let base = median(&mut rates[0].clone());
    println!("GPT-2 {LAYERS} layers, d {D}, 8 heads, seq {SEQ}; {MICRO} micro-batches of {BATCH}; AdamW; median of {ROUNDS} alternating rounds of {STEPS} steps");
    println!("| hp | parameters per rank (split layers) | params + AdamW state per rank vs hp 1 | all-reduced bytes per step per shard | Megatron's count | time in TP all-reduces | steps/s vs hp 1 |");
    println!("|---|---|---|---|---|---|---|");
    for (i, &hp) in sizes.iter().enumerate() {
        let (all, split) = held(&configs[i].0, hp);
        let share = match shares[i].is_empty() {
            true => "-".to_string(),
            false => format!("{:.1}%", 100.0 * median(&mut shares[i])),
        };
        println!(
            "| {hp} | {all} ({split}) | {:.3} | {} | {} | {share} | {:.2}x |",
            all as f64 / whole as f64,
            bytes[i],
            if hp > 1 { megatron } else { 0 },
            median(&mut rates[i]) / base,
        );
    }
}
