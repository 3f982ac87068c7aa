//! GPT-2 (Radford et al. 2019) as a forward ONNX graph: token and learned position
//! embeddings, pre-LayerNorm blocks of causal multi-head self-attention and a 4x MLP
//! with GELU, a final LayerNorm and a language-model head.
//!
//! Written in the operators pipetrain differentiates: GELU is the tanh approximation
//! GPT-2 uses, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, spelled in Pow, Mul,
//! Add and Tanh (opset 17 has no Gelu); the causal mask is an additive constant
//! (-1e9 above the diagonal) before Softmax. Every Reshape copies the batch axis (`0`)
//! or infers it (`-1`), so one model runs micro-batches of any size. Weight names and
//! layouts follow Hugging Face's `GPT2LMHeadModel` (`h.0.attn.c_attn.weight` is
//! `[d_model, 3 d_model]`, applied as `x @ W`), so its weights can be loaded by name.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::builder::{
    at_least_one, count_params, param_limit, rule, tensor_info, Builder, Dim, Init,
};
use crate::graph::{float_attr, int_attr, ints_attr};
use crate::onnx::proto::ModelProto;
use crate::tensor::{DType, Tensor};
use crate::Result;

/// LayerNorm's epsilon, as GPT-2's `layer_norm_epsilon`.
const LN_EPS: f32 = 1e-5;

/// What the causal mask adds above the diagonal: exp(-1e9 - max) is 0 in float32, and
/// unlike -inf it cannot make a NaN.
const MASKED: f32 = -1e9;

/// A GPT-2 language model. Defaults: a tiny model (2 layers, width 64, 4 heads,
/// vocabulary 64, context 32) that trains on two CPU cores in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct Gpt2Config {
    /// Vocabulary size.
    #[arg(long, default_value_t = Gpt2Config::DEFAULT.vocab)]
    pub vocab: usize,
    /// Context length T: the model reads `tokens` [batch, T].
    #[arg(long, default_value_t = Gpt2Config::DEFAULT.seq)]
    pub seq: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = Gpt2Config::DEFAULT.layers)]
    pub layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = Gpt2Config::DEFAULT.d_model)]
    pub d_model: usize,
    /// Attention heads (must divide `d_model`).
    #[arg(long, default_value_t = Gpt2Config::DEFAULT.heads)]
    pub heads: usize,
    /// Use the token embedding as the LM head (GPT-2 does). Off by default. Cut into
    /// pipeline stages, the first stage owns the embedding and hands it to the head's
    /// stage with each micro-batch (`graph/tied.rs`).
    #[arg(long)]
    pub tie_embeddings: bool,
    /// A fixed batch size; none: a dynamic batch dimension named `batch`.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = Gpt2Config::DEFAULT.seed)]
    pub seed: u64,
}

impl Gpt2Config {
    /// The defaults, as a constant (the command line's defaults too).
    pub const DEFAULT: Gpt2Config = Gpt2Config {
        vocab: 64,
        seq: 32,
        layers: 2,
        d_model: 64,
        heads: 4,
        tie_embeddings: false,
        batch: None,
        seed: 0,
    };

    /// Checks every field.
    ///
    /// # Errors
    /// `Config` naming the field (`model.heads`, ...) and the rule.
    pub fn validate(&self, path: &Path) -> Result<()> {
        at_least_one(
            path,
            &[
                ("model.vocab", self.vocab),
                ("model.seq", self.seq),
                ("model.layers", self.layers),
                ("model.d_model", self.d_model),
                ("model.heads", self.heads),
            ],
        )?;
        rule(
            self.d_model % self.heads == 0,
            path,
            "model.heads",
            format!(
                "must divide model.d_model ({} is not a multiple of {})",
                self.d_model, self.heads
            ),
        )?;
        if let Some(b) = self.batch {
            at_least_one(path, &[("model.batch", b)])?;
        }
        param_limit(path, "model", self.param_count())
    }

    /// Parameters the model holds (`None` when the count overflows).
    pub fn param_count(&self) -> Option<u64> {
        let (v, t, d) = (self.vocab, self.seq, self.d_model);
        let block = count_params(&[
            &[d],
            &[d],
            &[d, 3 * d],
            &[3 * d],
            &[d, d],
            &[d],
            &[d],
            &[d],
            &[d, 4 * d],
            &[4 * d],
            &[4 * d, d],
            &[d],
        ])?;
        let head: &[usize] = if self.tie_embeddings { &[0] } else { &[v, d] };
        let rest = count_params(&[&[v, d], &[t, d], &[d], &[d], head])?;
        block.checked_mul(self.layers as u64)?.checked_add(rest)
    }
}

impl Default for Gpt2Config {
    fn default() -> Self {
        Gpt2Config::DEFAULT
    }
}

/// Shared constants of every block.
struct Consts {
    split: String,
    to_heads: String,
    from_heads: String,
    scale: String,
    mask: String,
    gelu_cube: String,
    gelu_coef: String,
    gelu_sqrt: String,
    one: String,
    half: String,
}

/// The model: input `tokens` int64 [batch, T], output `logits` float32 [batch*T, vocab].
/// Initial weights as GPT-2's: N(0, 0.02), residual projections (`attn.c_proj`,
/// `mlp.c_proj`) N(0, 0.02/sqrt(2 layers)), biases 0, LayerNorm scale 1 and shift 0.
pub(crate) fn build(cfg: &Gpt2Config) -> Result<ModelProto> {
    let (v, t, d, h) = (cfg.vocab, cfg.seq, cfg.d_model, cfg.heads);
    let dh = d / h;
    let mut b = Builder::new(cfg.seed);
    let wte = b.weight("wte.weight", &[v, d], Init::Normal(0.02))?;
    let wpe = b.weight("wpe.weight", &[t, d], Init::Normal(0.02))?;

    let mut mask = vec![0.0f32; t * t];
    for i in 0..t {
        for j in i + 1..t {
            mask[i * t + j] = MASKED;
        }
    }
    let di = d as i64;
    let c = Consts {
        split: b.ints("attn.split_sizes", &[di, di, di]),
        to_heads: b.ints("attn.heads_shape", &[0, 0, h as i64, dh as i64]),
        from_heads: b.ints("attn.merged_shape", &[0, 0, di]),
        scale: b.scalar("attn.scale", 1.0 / (dh as f32).sqrt()),
        mask: b.constant("attn.causal_mask", Tensor::f32(vec![t, t], mask)?),
        gelu_cube: b.scalar("gelu.three", 3.0),
        gelu_coef: b.scalar("gelu.coef", 0.044715),
        gelu_sqrt: b.scalar("gelu.sqrt_2_over_pi", (2.0 / std::f32::consts::PI).sqrt()),
        one: b.scalar("gelu.one", 1.0),
        half: b.scalar("gelu.half", 0.5),
    };

    let tok = b.op("Gather", "embed.tokens", &[&wte, "tokens"], vec![]);
    let mut x = b.op("Add", "embed", &[&tok, &wpe], vec![]);
    let resid_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
    for i in 0..cfg.layers {
        x = block(&mut b, &c, &x, &format!("h.{i}"), d, resid_std)?;
    }
    let x = layer_norm(&mut b, &x, "ln_f", d)?;
    let rows = b.ints("lm_head.rows_shape", &[-1, di]);
    let x = b.op("Reshape", "lm_head.rows", &[&x, &rows], vec![]);
    let head = if cfg.tie_embeddings {
        wte
    } else {
        b.weight("lm_head.weight", &[v, d], Init::Normal(0.02))?
    };
    // Gemm with transB reads the head as [vocab, d_model], PyTorch's (and the tied
    // embedding's) layout.
    b.op("Gemm", "logits", &[&x, &head], vec![int_attr("transB", 1)]);

    let batch = Dim::batch(cfg.batch);
    let inputs = vec![tensor_info(
        "tokens",
        DType::I64,
        &[batch.clone(), Dim::Fixed(t)],
    )];
    let outputs = vec![tensor_info(
        "logits",
        DType::F32,
        &[batch.times(t), Dim::Fixed(v)],
    )];
    Ok(b.finish("gpt2", inputs, outputs))
}

/// `x + attn(ln_1(x))`, then `+ mlp(ln_2(.))`.
fn block(
    b: &mut Builder,
    c: &Consts,
    x: &str,
    p: &str,
    d: usize,
    resid_std: f64,
) -> Result<String> {
    let a = layer_norm(b, x, &format!("{p}.ln_1"), d)?;
    let qkv = linear(b, &a, &format!("{p}.attn.c_attn"), d, 3 * d, 0.02)?;
    let parts = b.op_n(
        "Split",
        &format!("{p}.attn.split"),
        &[&qkv, &c.split],
        3,
        vec![int_attr("axis", 2)],
    );
    let heads = |b: &mut Builder, v: &str, name: &str, perm: &[i64]| {
        let r = b.op(
            "Reshape",
            &format!("{p}.attn.{name}_heads"),
            &[v, &c.to_heads],
            vec![],
        );
        b.op(
            "Transpose",
            &format!("{p}.attn.{name}"),
            &[&r],
            vec![ints_attr("perm", perm)],
        )
    };
    // q, v: [B, heads, T, dh]; k pre-transposed to [B, heads, dh, T].
    let q = heads(b, &parts[0], "q", &[0, 2, 1, 3]);
    let k = heads(b, &parts[1], "k", &[0, 2, 3, 1]);
    let v = heads(b, &parts[2], "v", &[0, 2, 1, 3]);
    let s = b.op("MatMul", &format!("{p}.attn.scores"), &[&q, &k], vec![]);
    let s = b.op("Mul", &format!("{p}.attn.scaled"), &[&s, &c.scale], vec![]);
    let s = b.op("Add", &format!("{p}.attn.masked"), &[&s, &c.mask], vec![]);
    let w = b.op(
        "Softmax",
        &format!("{p}.attn.weights"),
        &[&s],
        vec![int_attr("axis", -1)],
    );
    let y = b.op("MatMul", &format!("{p}.attn.context"), &[&w, &v], vec![]);
    let y = b.op(
        "Transpose",
        &format!("{p}.attn.context_t"),
        &[&y],
        vec![ints_attr("perm", &[0, 2, 1, 3])],
    );
    let y = b.op(
        "Reshape",
        &format!("{p}.attn.merged"),
        &[&y, &c.from_heads],
        vec![],
    );
    let y = linear(b, &y, &format!("{p}.attn.c_proj"), d, d, resid_std)?;
    let x = b.op("Add", &format!("{p}.attn.residual"), &[x, &y], vec![]);

    let m = layer_norm(b, &x, &format!("{p}.ln_2"), d)?;
    let m = linear(b, &m, &format!("{p}.mlp.c_fc"), d, 4 * d, 0.02)?;
    let m = gelu(b, c, &m, &format!("{p}.mlp.gelu"));
    let m = linear(b, &m, &format!("{p}.mlp.c_proj"), 4 * d, d, resid_std)?;
    Ok(b.op("Add", &format!("{p}.mlp.residual"), &[&x, &m], vec![]))
}

/// `x @ W + b` with `W` [inputs, outputs] ~ N(0, std^2) and `b` = 0.
fn linear(
    b: &mut Builder,
    x: &str,
    p: &str,
    inputs: usize,
    outputs: usize,
    std: f64,
) -> Result<String> {
    let w = b.weight(
        &format!("{p}.weight"),
        &[inputs, outputs],
        Init::Normal(std),
    )?;
    let bias = b.weight(&format!("{p}.bias"), &[outputs], Init::Const(0.0))?;
    let y = b.op("MatMul", &format!("{p}.matmul"), &[x, &w], vec![]);
    Ok(b.op("Add", p, &[&y, &bias], vec![]))
}

/// LayerNormalization over the last axis, scale 1 and shift 0.
fn layer_norm(b: &mut Builder, x: &str, p: &str, d: usize) -> Result<String> {
    let g = b.weight(&format!("{p}.weight"), &[d], Init::Const(1.0))?;
    let s = b.weight(&format!("{p}.bias"), &[d], Init::Const(0.0))?;
    Ok(b.op(
        "LayerNormalization",
        p,
        &[x, &g, &s],
        vec![int_attr("axis", -1), float_attr("epsilon", LN_EPS)],
    ))
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn gelu(b: &mut Builder, c: &Consts, x: &str, p: &str) -> String {
    let cube = b.op("Pow", &format!("{p}.cube"), &[x, &c.gelu_cube], vec![]);
    let small = b.op(
        "Mul",
        &format!("{p}.cube_scaled"),
        &[&cube, &c.gelu_coef],
        vec![],
    );
    let inner = b.op("Add", &format!("{p}.inner"), &[x, &small], vec![]);
    let arg = b.op("Mul", &format!("{p}.arg"), &[&inner, &c.gelu_sqrt], vec![]);
    let th = b.op("Tanh", &format!("{p}.tanh"), &[&arg], vec![]);
    let gate = b.op("Add", &format!("{p}.gate"), &[&th, &c.one], vec![]);
    let hx = b.op("Mul", &format!("{p}.half_x"), &[x, &c.half], vec![]);
    b.op("Mul", p, &[&hx, &gate], vec![])
}
