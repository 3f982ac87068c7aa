//! Gradient rules, one function per operator, grouped by kind.
//!
//! A rule returns one entry per input of its node: the name of that input's gradient, or
//! `None` where the input needs none. Formulas follow the operators' ONNX definitions;
//! where ONNX Runtime's training gradient builder (orttraining `gradient_builder.cc`)
//! uses a training-only kernel, the rule writes the same math in standard ops.

mod elementwise;
mod linalg;
mod nn;
mod pool;
mod reduce;
mod shape;

use super::RuleCtx;
use crate::Result;

/// Gradients of one input each, `None` where not needed.
pub type Grads = Vec<Option<String>>;

/// The gradient rule for the node's operator; `Ok(None)` when the operator has none.
pub fn gradient(ctx: &mut RuleCtx) -> Result<Option<Grads>> {
    if !(ctx.node.domain.is_empty() || ctx.node.domain == "ai.onnx") {
        return Ok(None);
    }
    let grads = match ctx.node.op_type.as_str() {
        "Add" => elementwise::add_sub(ctx, false)?,
        "Sub" => elementwise::add_sub(ctx, true)?,
        "Mul" => elementwise::mul(ctx)?,
        "Div" => elementwise::div(ctx)?,
        "Neg" => elementwise::neg(ctx)?,
        "Pow" => elementwise::pow(ctx)?,
        "Sqrt" => elementwise::sqrt(ctx)?,
        "Exp" => elementwise::exp(ctx)?,
        "Log" => elementwise::log(ctx)?,
        "Erf" => elementwise::erf(ctx)?,
        "Tanh" => elementwise::tanh(ctx)?,
        "Sigmoid" => elementwise::sigmoid(ctx)?,
        "Relu" => elementwise::relu(ctx)?,
        "LeakyRelu" => elementwise::leaky_relu(ctx)?,
        "Gelu" => elementwise::gelu(ctx)?,
        "Where" => elementwise::where_(ctx)?,
        "Cast" => elementwise::cast(ctx)?,
        "Identity" => elementwise::identity(ctx)?,
        "Dropout" => elementwise::dropout(ctx)?,
        "MatMul" => linalg::matmul(ctx)?,
        "Gemm" => linalg::gemm(ctx)?,
        "Softmax" => nn::softmax(ctx, false)?,
        "LogSoftmax" => nn::softmax(ctx, true)?,
        "SoftmaxCrossEntropyLoss" => nn::softmax_cross_entropy(ctx)?,
        "LayerNormalization" => nn::layer_norm(ctx)?,
        "ReduceMean" => reduce::reduce(ctx, true)?,
        "ReduceSum" => reduce::reduce(ctx, false)?,
        "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => shape::reshape_like_input(ctx)?,
        "Transpose" => shape::transpose(ctx)?,
        "Concat" => shape::concat(ctx)?,
        "Split" => shape::split(ctx)?,
        "Slice" => shape::slice(ctx)?,
        "Gather" => shape::gather(ctx)?,
        "Expand" => shape::expand(ctx)?,
        "Conv" => pool::conv(ctx)?,
        "MaxPool" => pool::max_pool(ctx)?,
        "AveragePool" => pool::average_pool(ctx)?,
        "GlobalAveragePool" => pool::global_average_pool(ctx)?,
        _ => return Ok(None),
    };
    Ok(Some(grads))
}
