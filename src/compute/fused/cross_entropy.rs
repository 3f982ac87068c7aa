//! ONNX `SoftmaxCrossEntropyLoss` with classes on the last axis of rows (scores `[N, C]`
//! or `[N, C, 1, ...]`, int64 labels, no class weights, reduction `mean` or `sum`,
//! optional `ignore_index`), forward and backward, float32.
//!
//! `SoftmaxCrossEntropy`: `scores, labels` in, `loss, log_prob` out (as the ONNX
//! operator's two outputs), one pass for each row's maximum and one for its
//! exponentials, where stock ONNX Runtime runs the operator's function body
//! (`LogSoftmax` over a strided axis, then a negative log-likelihood): 5 kernels.
//! Row losses are summed per block, then over blocks in order.
//!
//! `SoftmaxCrossEntropyGrad`: `dloss, log_prob, labels` in, `dscores = w * (exp(log_prob)
//! - onehot(label))` out, `w` the loss's gradient over the counted rows (`mean`) or
//! itself (`sum`), 0 on ignored rows: one pass where the standard-op form is five.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, math, output, par_blocks, BLOCKS, LANES};
use crate::graph::custom_ops::{SOFTMAX_CROSS_ENTROPY, SOFTMAX_CROSS_ENTROPY_GRAD};

/// The attributes both kernels read.
#[derive(Clone, Copy)]
struct Reduction {
    /// `mean` (else `sum`).
    mean: bool,
    ignore_index: Option<i64>,
}

impl Reduction {
    fn of(info: &KernelContext<'_>, op: &str) -> ort::Result<Reduction> {
        let reduction = info
            .get::<String>("reduction")
            .unwrap_or_else(|| "mean".into());
        let mean = match reduction.as_str() {
            "mean" => true,
            "sum" => false,
            other => return Err(ort::Error::new(format!("{op}: reduction \"{other}\""))),
        };
        Ok(Reduction {
            mean,
            ignore_index: info.get::<i64>("ignore_index"),
        })
    }

    fn counts(&self, label: i64) -> bool {
        self.ignore_index != Some(label)
    }
}

/// The rows' label indices, checked against the class count.
fn labels<'a>(
    op: &str,
    labels: &'a [i64],
    rows: usize,
    classes: usize,
    r: Reduction,
) -> ort::Result<&'a [i64]> {
    if labels.len() != rows {
        return Err(ort::Error::new(format!(
            "{op}: {} labels for {rows} rows of scores",
            labels.len()
        )));
    }
    match labels
        .iter()
        .find(|&&l| r.counts(l) && !(0..classes as i64).contains(&l))
    {
        Some(l) => Err(ort::Error::new(format!(
            "{op}: label {l} is not a class index (0..{classes})"
        ))),
        None => Ok(labels),
    }
}

/// Softmax cross-entropy (forward) as one kernel.
pub(crate) struct SoftmaxCrossEntropy;

impl Operator for SoftmaxCrossEntropy {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        SOFTMAX_CROSS_ENTROPY
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Int64),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        (0..2).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        const OP: &str = SOFTMAX_CROSS_ENTROPY;
        let r = Reduction::of(info, OP)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let (x, l) = (input(ctx, OP, 0)?, input(ctx, OP, 1)?);
            let (shape, x) = x.try_extract_tensor::<f32>()?;
            let (_, l) = l.try_extract_tensor::<i64>()?;
            let rows = shape.first().copied().unwrap_or(1).max(1) as usize;
            let cols = x.len() / rows;
            let l = labels(OP, l, rows, cols, r)?;
            let mut lp = output(ctx, OP, 1, shape)?;
            let (_, lp) = lp.try_extract_tensor_mut::<f32>()?;
            let per = rows.div_ceil(BLOCKS).max(1);
            let sums: Vec<std::sync::Mutex<f32>> = (0..BLOCKS).map(|_| 0f32.into()).collect();
            par_blocks(ctx, lp, cols, |at, lp| {
                let (row, mut total) = (at / cols, 0f32);
                let x = x[at..at + lp.len()].chunks_exact(cols);
                for (i, (x, lp)) in x.zip(lp.chunks_exact_mut(cols)).enumerate() {
                    log_softmax_row(x, lp);
                    let label = l[row + i];
                    if r.counts(label) {
                        total -= lp[label as usize];
                    }
                }
                if let Ok(mut s) = sums[row / per].lock() {
                    *s = total;
                }
            })?;
            let mut loss = 0f32;
            for s in sums {
                loss += s.into_inner().unwrap_or(f32::NAN);
            }
            if r.mean {
                loss /= l.iter().filter(|&&v| r.counts(v)).count() as f32;
            }
            let mut out = output(ctx, OP, 0, &[])?;
            let (_, out) = out.try_extract_tensor_mut::<f32>()?;
            out[0] = loss;
            Ok(())
        }))
    }
}

/// One row's log-softmax: `lp = x - (max + ln(sum(exp(x - max))))`.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn log_softmax_row(x: &[f32], lp: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; LANES];
    let whole = x.len() / LANES * LANES;
    for x in x[..whole].chunks_exact(LANES) {
        for l in 0..LANES {
            m[l] = m[l].max(x[l]);
        }
    }
    let max = x[whole..]
        .iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    // The exponentials in `lp` first: a plain loop is what vectorizes `exp`.
    for (lp, &x) in lp.iter_mut().zip(x) {
        *lp = math::exp(x - max);
    }
    let s = super::lane_sum(lp);
    let lse = max + s.ln();
    for (lp, &x) in lp.iter_mut().zip(x) {
        *lp = x - lse;
    }
}

/// Softmax cross-entropy's backward as one kernel.
pub(crate) struct SoftmaxCrossEntropyGrad;

impl Operator for SoftmaxCrossEntropyGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        SOFTMAX_CROSS_ENTROPY_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Int64),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        const OP: &str = SOFTMAX_CROSS_ENTROPY_GRAD;
        let r = Reduction::of(info, OP)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let (dl, lp, l) = (input(ctx, OP, 0)?, input(ctx, OP, 1)?, input(ctx, OP, 2)?);
            let (_, dl) = dl.try_extract_tensor::<f32>()?;
            let (shape, lp) = lp.try_extract_tensor::<f32>()?;
            let (_, l) = l.try_extract_tensor::<i64>()?;
            let rows = shape.first().copied().unwrap_or(1).max(1) as usize;
            let cols = lp.len() / rows;
            let l = labels(OP, l, rows, cols, r)?;
            let mut w = dl.first().copied().unwrap_or(f32::NAN);
            if r.mean {
                w /= l.iter().filter(|&&v| r.counts(v)).count() as f32;
            }
            let mut dx = output(ctx, OP, 0, shape)?;
            let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
            par_blocks(ctx, dx, cols, |at, dx| {
                let lp = lp[at..at + dx.len()].chunks_exact(cols);
                for (i, (lp, dx)) in lp.zip(dx.chunks_exact_mut(cols)).enumerate() {
                    let label = l[at / cols + i];
                    if r.counts(label) {
                        grad_row(lp, w, dx);
                        dx[label as usize] -= w;
                    } else {
                        dx.fill(0.0);
                    }
                }
            })
        }))
    }
}

/// One row's `w * exp(lp)`.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn grad_row(lp: &[f32], w: f32, dx: &mut [f32]) {
    for (dx, &lp) in dx.iter_mut().zip(lp) {
        *dx = w * math::exp(lp);
    }
}
