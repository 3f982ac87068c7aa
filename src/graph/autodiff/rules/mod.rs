//! Gradient rules, one function per operator, grouped by kind.
//!
//! A rule returns one entry per input of its node: the name of that input's gradient, or
//! `None` where the input needs none. Formulas follow the operators' ONNX definitions;
//! where ONNX Runtime's training gradient builder (orttraining `gradient_builder.cc`)
//! uses a training-only kernel, the rule writes the same math in standard ops.

mod activation;
mod conv;
mod det;
mod einsum;
mod elementwise;
mod fused;
mod grid_sample;
mod index;
mod layout;
mod linalg;
mod lp_pool;
mod lrn;
mod nn;
mod norm;
mod pad;
mod pool;
mod recurrent;
mod reduce;
mod resize;
mod rows_add;
mod shape;
mod unary;
mod unpool_crop;

use super::RuleCtx;
use crate::Result;

/// Gradients of one input each, `None` where not needed.
pub type Grads = Vec<Option<String>>;

/// A gradient rule.
type Rule = fn(&mut RuleCtx) -> Result<Grads>;

/// Every default-domain operator with a gradient rule, and its rule (the README's list of
/// operators without one is checked against this table: `tests/it/readme_ops.rs`).
const RULES: &[(&str, Rule)] = &[
    ("Add", |c| elementwise::add_sub(c, false)),
    ("Sub", |c| elementwise::add_sub(c, true)),
    ("Mul", elementwise::mul),
    ("Div", elementwise::div),
    ("Neg", elementwise::neg),
    ("Pow", elementwise::pow),
    ("Sqrt", elementwise::sqrt),
    ("Exp", elementwise::exp),
    ("Log", elementwise::log),
    ("Erf", elementwise::erf),
    ("Tanh", elementwise::tanh),
    ("Sigmoid", elementwise::sigmoid),
    ("Relu", elementwise::relu),
    ("LeakyRelu", elementwise::leaky_relu),
    ("Gelu", elementwise::gelu),
    ("Where", elementwise::where_),
    ("Cast", elementwise::cast),
    ("CastLike", elementwise::cast_like),
    ("Identity", elementwise::identity),
    ("Dropout", elementwise::dropout),
    ("MatMul", linalg::matmul),
    ("Det", det::det),
    ("Einsum", einsum::einsum),
    ("Gemm", linalg::gemm),
    ("Softmax", |c| nn::softmax(c, false)),
    ("LogSoftmax", |c| nn::softmax(c, true)),
    ("SoftmaxCrossEntropyLoss", nn::softmax_cross_entropy),
    ("LayerNormalization", nn::layer_norm),
    ("ReduceMean", |c| reduce::reduce(c, true)),
    ("ReduceSum", |c| reduce::reduce(c, false)),
    ("Reshape", shape::reshape_like_input),
    ("Flatten", shape::reshape_like_input),
    ("Squeeze", shape::reshape_like_input),
    ("Unsqueeze", shape::reshape_like_input),
    ("Transpose", shape::transpose),
    ("Concat", shape::concat),
    ("Split", shape::split),
    ("Slice", shape::slice),
    ("Gather", shape::gather),
    ("Expand", shape::expand),
    ("Abs", activation::abs),
    ("Reciprocal", activation::reciprocal),
    ("Sin", activation::sin),
    ("Cos", activation::cos),
    ("Softplus", activation::softplus),
    ("Clip", activation::clip),
    ("HardSigmoid", activation::hard_sigmoid),
    ("HardSwish", activation::hard_swish),
    ("Min", |c| activation::min_max(c, false)),
    ("Max", |c| activation::min_max(c, true)),
    ("Sum", activation::sum),
    ("ReduceMax", reduce::reduce_max),
    ("ReduceMin", reduce::reduce_max),
    ("ReduceL2", |c| reduce::reduce_pointwise(c, "ReduceL2")),
    ("ReduceL1", |c| reduce::reduce_pointwise(c, "ReduceL1")),
    ("ReduceSumSquare", |c| {
        reduce::reduce_pointwise(c, "ReduceSumSquare")
    }),
    ("ReduceLogSum", |c| {
        reduce::reduce_pointwise(c, "ReduceLogSum")
    }),
    ("ReduceLogSumExp", |c| {
        reduce::reduce_pointwise(c, "ReduceLogSumExp")
    }),
    ("GatherElements", index::gather_elements),
    ("GatherND", index::gather_nd),
    ("ScatterElements", index::scatter_elements),
    ("ScatterND", index::scatter_nd),
    ("TopK", index::top_k),
    ("Trilu", index::trilu),
    ("Atan", activation::atan),
    ("GroupNormalization", norm::group_norm),
    ("GlobalMaxPool", pool::global_max_pool),
    ("Asin", |c| unary::trig(c, "Asin")),
    ("Acos", |c| unary::trig(c, "Acos")),
    ("Atanh", |c| unary::trig(c, "Atanh")),
    ("Asinh", |c| unary::trig(c, "Asinh")),
    ("Acosh", |c| unary::trig(c, "Acosh")),
    ("Sinh", |c| unary::trig(c, "Sinh")),
    ("Cosh", |c| unary::trig(c, "Cosh")),
    ("Tan", |c| unary::trig(c, "Tan")),
    ("Elu", |c| unary::exponential_linear(c, "Elu")),
    ("Celu", |c| unary::exponential_linear(c, "Celu")),
    ("Selu", |c| unary::exponential_linear(c, "Selu")),
    ("Mish", unary::mish),
    ("Softsign", unary::softsign),
    ("ThresholdedRelu", |c| unary::thresholded(c, false)),
    ("Shrink", |c| unary::thresholded(c, true)),
    ("PRelu", unary::prelu),
    ("Mod", unary::modulo),
    ("Mean", unary::mean),
    ("Hardmax", activation::piecewise_constant),
    ("DepthToSpace", |c| layout::depth_space(c, true)),
    ("SpaceToDepth", |c| layout::depth_space(c, false)),
    ("LpNormalization", norm::lp_norm),
    ("MeanVarianceNormalization", norm::mean_variance_norm),
    ("NegativeLogLikelihoodLoss", nn::nll_loss),
    ("Sign", activation::piecewise_constant),
    ("Floor", activation::piecewise_constant),
    ("Ceil", activation::piecewise_constant),
    ("Round", activation::piecewise_constant),
    ("BatchNormalization", norm::batch_norm),
    ("InstanceNormalization", norm::instance_norm),
    ("Tile", layout::tile),
    ("Pad", pad::pad),
    ("CumSum", layout::cumsum),
    ("Conv", conv::conv),
    ("ConvTranspose", conv::conv_transpose),
    ("Resize", resize::resize),
    ("MaxPool", pool::max_pool),
    ("AveragePool", pool::average_pool),
    ("GlobalAveragePool", pool::global_average_pool),
    ("LSTM", recurrent::lstm),
    ("GRU", recurrent::gru),
    ("RNN", recurrent::rnn),
    ("GridSample", grid_sample::grid_sample),
    ("LpPool", lp_pool::lp_pool),
    ("GlobalLpPool", lp_pool::global_lp_pool),
    ("ReduceProd", reduce::reduce_prod),
    ("LRN", lrn::lrn),
    ("MaxUnpool", unpool_crop::max_unpool),
    ("Compress", unpool_crop::compress),
    ("CenterCropPad", unpool_crop::center_crop_pad),
    ("Col2Im", unpool_crop::col2im),
];

/// The gradient rule of a default-domain operator, if it has one.
fn rule(op_type: &str) -> Option<Rule> {
    RULES.iter().find(|(op, _)| *op == op_type).map(|&(_, r)| r)
}

/// The default-domain operators with a gradient rule, in the table's order.
pub fn ruled_ops() -> impl Iterator<Item = &'static str> {
    RULES.iter().map(|&(op, _)| op)
}

/// The gradient rule of one of pipetrain's tensor-shard collectives: Megatron-LM's
/// pair, each the other's gradient.
fn shard_rule(op_type: &str) -> Option<Rule> {
    use crate::graph::tensor_parallel::{ALL_REDUCE, SHARD_ENTRY};
    let rule: Rule = match op_type {
        // The sum of the shards' partial products: every shard's part gets the
        // (replicated) gradient of the sum.
        ALL_REDUCE => |c| Ok(vec![Some(c.dy(0)?)]),
        // A replicated input read by every shard's split computation: its gradient is
        // the sum of the shards' partial gradients.
        SHARD_ENTRY => |c| {
            let dy = c.dy(0)?;
            Ok(vec![Some(c.e.custom_op(ALL_REDUCE, &[&dy], vec![]))])
        },
        _ => return None,
    };
    Some(rule)
}

/// The rule of a node of this operator and domain, if it has one.
fn rule_of(op_type: &str, domain: &str) -> Option<Rule> {
    match domain {
        "" | "ai.onnx" => rule(op_type),
        crate::graph::custom_ops::DOMAIN => shard_rule(op_type).or_else(|| fused::rule(op_type)),
        "com.microsoft" if op_type == "FusedMatMul" => Some(linalg::fused_matmul),
        _ => None,
    }
}

/// Whether a node of this operator and domain can be differentiated (its rule may still
/// refuse particular attributes).
pub fn has_rule(op_type: &str, domain: &str) -> bool {
    rule_of(op_type, domain).is_some()
}

/// The gradient rule for the node's operator; `Ok(None)` when the operator has none.
pub fn gradient(ctx: &mut RuleCtx) -> Result<Option<Grads>> {
    match rule_of(&ctx.node.op_type, &ctx.node.domain) {
        Some(rule) => rule(ctx).map(Some),
        None => Ok(None),
    }
}
