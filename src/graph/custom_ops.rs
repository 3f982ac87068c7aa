//! pipetrain's own operators (domain `ai.pipetrain`), which its graphs may hold beside
//! standard ONNX ops and run on stock ONNX Runtime as custom operators
//! (`compute::shard_ops`, `compute::fused_ops`). Graphs that leave pipetrain (exported
//! models, `model_with_training_graph_path`) hold none of them.

/// The domain of pipetrain's own operators.
pub const DOMAIN: &str = "ai.pipetrain";
/// Sum over the tensor shards (forward); identity gradient.
pub const ALL_REDUCE: &str = "AllReduce";
/// Identity (forward); the gradient is summed over the tensor shards.
pub const SHARD_ENTRY: &str = "ShardEntry";
/// LayerNormalization's backward in one kernel: `dY, X, scale, mean, inv_std` in,
/// `dX, dscale, dbias` out.
pub const LAYER_NORM_GRAD: &str = "LayerNormGrad";
/// Softmax's backward over the last axis in one kernel: `dY, Y` in, `dX = Y * (dY -
/// sum(dY * Y))` out.
pub const SOFTMAX_GRAD: &str = "SoftmaxGrad";
/// Softmax over the last axis (forward), float32: `X` in, `Y` out.
pub const SOFTMAX: &str = "Softmax";
/// ONNX `SoftmaxCrossEntropyLoss` over rows (classes on the last axis, int64 labels,
/// attributes `reduction` and `ignore_index`): `scores, labels` in, `loss, log_prob` out.
pub const SOFTMAX_CROSS_ENTROPY: &str = "SoftmaxCrossEntropy";
/// Its backward: `dloss, log_prob, labels` in, `dscores` out (same attributes).
pub const SOFTMAX_CROSS_ENTROPY_GRAD: &str = "SoftmaxCrossEntropyGrad";
/// PyTorch's erf GELU whole, float32: `X` in, `Y, E` out (`E = erf(t)`, kept for the
/// backward); `t = X / scale` where attribute `divide` is 1, else `X * scale`.
pub const ERF_GELU: &str = "ErfGelu";
/// Its backward: `dY, X, E` in, `dX` out (same attributes).
pub const GELU_GRAD: &str = "GeluGrad";
/// GPT-2's tanh GELU whole, float32: `X` in, `Y = 0.5 x (1 + tanh(scale (x + coef
/// x^3)))` out; attributes `scale` (sqrt(2 / pi)) and `coef` (0.044715) as the graph had
/// them (`graph::fusion::fuse_tanh_gelu`; kernels in `compute/fused` and
/// `compute/cuda_fused.rs`).
pub const TANH_GELU: &str = "TanhGelu";
/// `acc, g` in, `acc + g` out, float32, elementwise: a gradient added into its
/// accumulator (`graph::accumulating`; kernel in `compute/fused/accumulate.rs`).
pub const ACCUMULATE: &str = "Accumulate";
/// Its backward: `dY, X` in, `dX` out (same attributes).
pub const TANH_GELU_GRAD: &str = "TanhGeluGrad";
/// ReLU's backward: `dY, X` in, `dX = X > 0 ? dY : 0` out.
pub const RELU_GRAD: &str = "ReluGrad";
/// Depthwise 2-D convolution (`Conv` with `group` = channels, one filter each), NCHW,
/// float32: `X, W[, B]` in, `Y` out; attributes `strides`, `pads`, `dilations`.
pub const DEPTHWISE_CONV: &str = "DepthwiseConv";
/// Its backward: `dY, X, W` in, `dX, dW, dB` out (same attributes).
pub const DEPTHWISE_CONV_GRAD: &str = "DepthwiseConvGrad";
/// Scaled dot-product attention (float32): `Q, K, V[, mask]` in, `O, P` out; attributes
/// `scale`, `causal` and `q_perm`, `k_perm`, `v_perm`, `out_perm` (the transposes around
/// the products, read through strides). See `compute::fused` (attention).
/// With attribute `lse = 1` the second output is each query row's log-sum-exp of its
/// scores, `L` (`[B, H, T]`), instead of `P`.
pub const ATTENTION: &str = "Attention";
/// Its backward: `dO, Q, K, V, P` in (with `lse`: `dO, Q, K, V, L, O[, mask]`), `dQ, dK,
/// dV` out (same attributes).
pub const ATTENTION_GRAD: &str = "AttentionGrad";
/// The head sizes the GPU's `lse` attention (the flash kernels) is compiled for; the
/// queries' and the values' must be equal.
pub const FLASH_HEAD_SIZES: [usize; 4] = [16, 32, 64, 128];
/// `Attention` on one packed `[B, T, W]` tensor whose last axis holds Q, K and V (as a
/// fused projection's output before its `Split`): `QKV[, mask]` in, `O, P` out; also
/// attributes `heads_dim` (`[H, D]`) and `offsets` (where Q, K, V start on the last
/// axis, each `[B, T, H, D]` before its permutation).
pub const PACKED_ATTENTION: &str = "PackedAttention";
/// Its backward: `dO, QKV, P` in (with `lse`: `dO, QKV, L, O[, mask]`), `dQKV` out (same
/// attributes).
pub const PACKED_ATTENTION_GRAD: &str = "PackedAttentionGrad";
/// An embedding (`Gather`) gradient that sums in a fixed order on a GPU: `indices`
/// (int64, n values) and `updates` (float32, n rows) in, attribute `rows`; out the table
/// `[rows, row length]`, row v the sum of the updates whose index is v, in index order
/// from +0 (the bits of `ScatterElements(reduction = add)` into zeros on the CPU). A CUDA
/// kernel (`compute/cuda_ops.rs`); `graph::scatter_adds_as_rows_add` writes it.
pub const ROWS_ADD: &str = "RowsAdd";
/// A training-mode `Dropout` drawing its mask from a key (float32): `X, ratio, key` in
/// (`key` int64, fed with each micro-batch: seed, step, replica, micro-batch), `Y, mask`
/// out as `Dropout`'s; attribute `salt` tells the nodes apart. `graph::keyed_dropout`
/// writes it; kernel in `compute/fused/dropout.rs`.
pub const KEYED_DROPOUT: &str = "KeyedDropout";
/// A float32 matrix product by a CBLAS (MKL or OpenBLAS) on the CPU: `A, B[, C]` in,
/// `Y = alpha op(A) op(B) + beta C` out, attributes `transA`, `transB`, `alpha`, `beta` as `Gemm`'s; `B` a
/// matrix, `A` a matrix or (untransposed) rows `[..., M, K]`; `C` `[N]`, `[1, N]` or
/// `[M, N]`. `graph::fusion::blas_products` writes it; kernel in
/// `compute/fused/product.rs`.
pub const BLAS_MATMUL: &str = "BlasMatMul";
