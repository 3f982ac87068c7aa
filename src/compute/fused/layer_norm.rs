//! `LayerNormGrad`: LayerNormalization's backward in one pass over each row, where the
//! standard-op form is 12 kernels (each a full pass over the tensor, most with a
//! broadcast) and two reductions over the rows. Inputs `dY, X, scale, mean, inv_std` (the
//! forward's saved statistics), outputs `dX, dscale, dbias`; normalization over the
//! trailing axes that `scale` spans. The arithmetic is the standard-op form's, in the same
//! order per element (`dX = inv * (g - mean(g) - xhat * mean(g * xhat))`, `g = dY *
//! scale`); the row means are summed in eight lanes and the column sums over rows in row
//! order, so it matches the standard-op graph within float32 rounding, not bitwise.

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, output, BLOCKS, LANES};
use crate::graph::custom_ops::LAYER_NORM_GRAD;

/// LayerNormalization's backward as one kernel.
pub(crate) struct LayerNormGrad;

impl Operator for LayerNormGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        LAYER_NORM_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..5).map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        (0..3).map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| {
            const OP: &str = LAYER_NORM_GRAD;
            let input = |i: usize| input(ctx, OP, i);
            let (dy, x, scale, mean, inv) = (input(0)?, input(1)?, input(2)?, input(3)?, input(4)?);
            let (x_shape, x) = x.try_extract_tensor::<f32>()?;
            let (_, dy) = dy.try_extract_tensor::<f32>()?;
            let (scale_shape, scale) = scale.try_extract_tensor::<f32>()?;
            let (_, mean) = mean.try_extract_tensor::<f32>()?;
            let (_, inv) = inv.try_extract_tensor::<f32>()?;
            let cols = scale.len();
            if cols == 0
                || x.len() % cols != 0
                || dy.len() != x.len()
                || mean.len() * cols != x.len()
                || inv.len() != mean.len()
            {
                return Err(ort::Error::new(format!(
                    "LayerNormGrad: X of {} values, dY {}, scale {cols}, statistics {} and {}",
                    x.len(),
                    dy.len(),
                    mean.len(),
                    inv.len()
                )));
            }
            let mut dx = output(ctx, OP, 0, x_shape)?;
            let mut ds = output(ctx, OP, 1, scale_shape)?;
            let mut db = output(ctx, OP, 2, scale_shape)?;
            let (_, dx) = dx.try_extract_tensor_mut::<f32>()?;
            let (_, ds) = ds.try_extract_tensor_mut::<f32>()?;
            let (_, db) = db.try_extract_tensor_mut::<f32>()?;
            let rows = Rows { dy, x, mean, inv };
            layer_norm_grad_parallel(ctx, rows, scale, (dx, ds, db))
        }))
    }
}

/// The row-wise inputs of [`layer_norm_grad`].
pub(crate) struct Rows<'a> {
    pub dy: &'a [f32],
    pub x: &'a [f32],
    /// One per row.
    pub mean: &'a [f32],
    /// One per row.
    pub inv: &'a [f32],
}

/// LayerNormalization's backward over rows of `scale.len()` values: `dx`, and the sums
/// over rows of `dy * xhat` (`dscale`) and of `dy` (`dbias`).
pub(crate) fn layer_norm_grad(
    r: Rows<'_>,
    scale: &[f32],
    (dx, dscale, dbias): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let cols = scale.len();
    dscale.fill(0.0);
    dbias.fill(0.0);
    let inv_cols = 1.0 / cols as f32;
    let rows = r.dy.chunks_exact(cols).zip(r.x.chunks_exact(cols));
    for (i, ((dy, x), dx)) in rows.zip(dx.chunks_exact_mut(cols)).enumerate() {
        let stats = (r.mean[i], r.inv[i], inv_cols);
        row(dy, x, scale, stats, dx, (dscale, dbias));
    }
}

/// One block's rows of `dx`, and its column sums (`dscale`, `dbias`).
type Block<'a> = (&'a mut [f32], Vec<f32>, Vec<f32>);

/// [`layer_norm_grad`] in [`BLOCKS`] blocks of rows on ONNX Runtime's intra-op threads.
fn layer_norm_grad_parallel(
    ctx: &ComputeContext,
    r: Rows<'_>,
    scale: &[f32],
    (dx, dscale, dbias): (&mut [f32], &mut [f32], &mut [f32]),
) -> ort::Result<()> {
    let cols = scale.len();
    let rows = r.mean.len();
    let per = rows.div_ceil(BLOCKS).max(1);
    let blocks: Vec<std::sync::Mutex<Block<'_>>> = dx
        .chunks_mut(per * cols)
        .map(|d| std::sync::Mutex::new((d, vec![0f32; cols], vec![0f32; cols])))
        .collect();
    ctx.par_for(blocks.len(), blocks.len(), |b| {
        let Ok(mut block) = blocks[b].lock() else {
            return;
        };
        let (dx, ds, db) = &mut *block;
        let (lo, hi) = (b * per, (b * per + per).min(rows));
        let part = Rows {
            dy: &r.dy[lo * cols..hi * cols],
            x: &r.x[lo * cols..hi * cols],
            mean: &r.mean[lo..hi],
            inv: &r.inv[lo..hi],
        };
        layer_norm_grad(part, scale, (dx, ds, db));
    })?;
    dscale.fill(0.0);
    dbias.fill(0.0);
    for block in blocks {
        let (_, ds, db) = block
            .into_inner()
            .map_err(|_| ort::Error::new("LayerNormGrad: a block panicked"))?;
        dscale.iter_mut().zip(&ds).for_each(|(a, b)| *a += b);
        dbias.iter_mut().zip(&db).for_each(|(a, b)| *a += b);
    }
    Ok(())
}

/// One row: its two means (in `LANES` partial sums), its `dx`, and its share of the
/// column sums. Whole lanes as fixed-size chunks (what vectorizes without bounds
/// checks), then the rest.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn row(
    dy: &[f32],
    x: &[f32],
    scale: &[f32],
    (mu, inv, inv_cols): (f32, f32, f32),
    dx: &mut [f32],
    (dscale, dbias): (&mut [f32], &mut [f32]),
) {
    let (mut s1, mut s2) = ([0f32; LANES], [0f32; LANES]);
    let whole = dy.len() / LANES * LANES;
    let xh = |x: f32| (x - mu) * inv;
    // One pass per sum, column sums apart: in one loop the compiler paired the sums'
    // lanes the wrong way (or, with `dscale` and `dbias` written in place, not at all)
    // and the loop ran scalar. The rows are in L1; the extra passes are cheap.
    let lanes = || {
        dy[..whole]
            .chunks_exact(LANES)
            .zip(x[..whole].chunks_exact(LANES))
            .zip(scale[..whole].chunks_exact(LANES))
    };
    for ((dy, _), sc) in lanes() {
        for l in 0..LANES {
            s1[l] += dy[l] * sc[l];
        }
    }
    for ((dy, x), sc) in lanes() {
        for l in 0..LANES {
            s2[l] += dy[l] * sc[l] * xh(x[l]);
        }
    }
    let sums = dscale[..whole].iter_mut().zip(&mut dbias[..whole]);
    for (((ds, db), &dy), &x) in sums.zip(&dy[..whole]).zip(&x[..whole]) {
        *ds += dy * xh(x);
        *db += dy;
    }
    for j in whole..dy.len() {
        let xh = (x[j] - mu) * inv;
        let g = dy[j] * scale[j];
        s1[0] += g;
        s2[0] += g * xh;
        dscale[j] += dy[j] * xh;
        dbias[j] += dy[j];
    }
    let m1 = s1.iter().sum::<f32>() * inv_cols;
    let m2 = s2.iter().sum::<f32>() * inv_cols;
    let out = dx.iter_mut().zip(dy).zip(x).zip(scale);
    for (((dx, &dy), &x), &sc) in out {
        let xh = (x - mu) * inv;
        *dx = (dy * sc - m1 - xh * m2) * inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formula in float64, row by row.
    fn reference(dy: &[f64], x: &[f64], scale: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let c = scale.len();
        let (mut dx, mut ds, mut db) = (vec![0.0; x.len()], vec![0.0; c], vec![0.0; c]);
        for r in 0..x.len() / c {
            let xs = &x[r * c..(r + 1) * c];
            let mu = xs.iter().sum::<f64>() / c as f64;
            let var = xs.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / c as f64;
            let inv = 1.0 / (var + eps).sqrt();
            let xh: Vec<f64> = xs.iter().map(|v| (v - mu) * inv).collect();
            let g: Vec<f64> = (0..c).map(|j| dy[r * c + j] * scale[j]).collect();
            let m1 = g.iter().sum::<f64>() / c as f64;
            let m2 = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / c as f64;
            for j in 0..c {
                dx[r * c + j] = inv * (g[j] - m1 - xh[j] * m2);
                ds[j] += dy[r * c + j] * xh[j];
                db[j] += dy[r * c + j];
            }
        }
        (dx, ds, db)
    }

    #[test]
    fn matches_the_float64_formula() {
        let (rows, cols, eps) = (13, 37, 1e-5);
        let wave = |k: usize, a: f64| ((k as f64 * a).sin() * 1.7) as f32;
        let x: Vec<f32> = (0..rows * cols).map(|k| wave(k, 0.37) + 0.2).collect();
        let dy: Vec<f32> = (0..rows * cols).map(|k| wave(k, 0.91)).collect();
        let scale: Vec<f32> = (0..cols).map(|k| 1.0 + wave(k, 1.3) * 0.1).collect();
        let (mut mean, mut inv) = (vec![0f32; rows], vec![0f32; rows]);
        for r in 0..rows {
            let xs: Vec<f64> = x[r * cols..(r + 1) * cols]
                .iter()
                .map(|&v| v as f64)
                .collect();
            let mu = xs.iter().sum::<f64>() / cols as f64;
            let var = xs.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / cols as f64;
            mean[r] = mu as f32;
            inv[r] = (1.0 / (var + eps).sqrt()) as f32;
        }
        let (mut dx, mut ds, mut db) =
            (vec![0f32; rows * cols], vec![0f32; cols], vec![0f32; cols]);
        let r = Rows {
            dy: &dy,
            x: &x,
            mean: &mean,
            inv: &inv,
        };
        layer_norm_grad(r, &scale, (&mut dx, &mut ds, &mut db));
        let f = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<_>>();
        let (wx, ws, wb) = reference(&f(&dy), &f(&x), &f(&scale), eps);
        for (got, want) in [(&dx, &wx), (&ds, &ws), (&db, &wb)] {
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            let err = got
                .iter()
                .zip(want.iter())
                .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
            assert!(err < 1e-5 * scale.max(1.0), "{err:e} of {scale}");
        }
    }
}
