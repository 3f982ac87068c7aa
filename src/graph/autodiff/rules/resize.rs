//! The gradient of `Resize`. Resize (nearest, linear or cubic, any coordinate
//! transformation, scales or sizes for every axis or for the `axes` listed) is affine in
//! X and works axis by axis: along each resized axis `k`, `Y = A_k X + c_k` with `A_k`
//! the `[out_k, in_k]` interpolation matrix (`c_k` is `tf_crop_and_resize`'s
//! extrapolation value outside its region, 0 otherwise). Its adjoint applies each `A_k^T`
//! to dY. `A_k` comes from the same Resize run on an identity (basis vectors stacked on
//! axis 0, resized along `k` alone; for `tf_crop_and_resize`, less the same Resize of
//! zeros), so dX follows exactly the interpolation ONNX Runtime computed, whatever its mode
//! and rounding.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_ints, attr_s, ints_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

pub fn resize(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let (sx, sy) = (shape(ctx, &x)?, shape(ctx, ctx.output(0))?);
    let t = dtype(ctx, &x)?;
    let crop =
        attr_s(ctx.node, "coordinate_transformation_mode").as_deref() == Some("tf_crop_and_resize");
    let rank = sx.len();
    // The axes the scales, sizes and region list (all by default).
    let listed: Vec<usize> = match attr_ints(ctx.node, "axes") {
        Some(a) => a
            .iter()
            .map(|&v| (if v < 0 { v + rank as i64 } else { v }) as usize)
            .collect(),
        None => (0..rank).collect(),
    };
    let scales = match constant_floats(ctx, 2)? {
        Some(s) if !s.is_empty() => Some(s),
        _ => None,
    };
    let roi = match crop {
        true => constant_floats(ctx, 1)?,
        false => None,
    };
    let scale_of = |k: usize| {
        let at = listed.iter().position(|&a| a == k)?;
        scales.as_ref().map(|s| s[at])
    };
    // A region other than the whole axis crops it, whatever its size.
    let cropped = |k: usize| {
        let (Some(r), Some(at)) = (roi.as_ref(), listed.iter().position(|&a| a == k)) else {
            return false;
        };
        let m = listed.len();
        r.len() == 2 * m && (r[at] != 0.0 || r[m + at] != 1.0)
    };
    let resized: Vec<usize> = (0..rank)
        .filter(|&k| listed.contains(&k))
        .filter(|&k| sx[k] != sy[k] || scale_of(k).is_some_and(|s| s != 1.0) || cropped(k))
        .collect();
    if resized.contains(&0) {
        return Err(ctx.unsupported("resizing the batch axis"));
    }
    let attrs = ctx.node.attribute.clone();
    let mut g = dy;
    for k in resized {
        let (n_in, n_out) = (sx[k], sy[k]);
        // Basis vector i on axis 0, at position i of axis k.
        let mut eye_shape = vec![1; rank];
        eye_shape[0] = n_in;
        eye_shape[k] = n_in;
        let mut v = vec![0.0; n_in * n_in];
        for i in 0..n_in {
            v[i * n_in + i] = 1.0;
        }
        let eye = ctx.e.constant(float(t, eye_shape.clone(), v)?);
        let along = Along {
            listed: &listed,
            k,
            eye_shape: &eye_shape,
            n_out,
        };
        let inputs = along.inputs(ctx, scale_of(k), roi.as_deref())?;
        let refs: Vec<&str> = std::iter::once(eye.as_str())
            .chain(inputs.iter().map(String::as_str))
            .collect();
        let mut along_k = ctx.e.op("Resize", &refs, attrs.clone());
        if crop {
            // Less what the region's extrapolated part adds whatever X holds.
            let zeros = ctx.e.constant(Tensor::zeros(t, eye_shape.clone()));
            let refs: Vec<&str> = std::iter::once(zeros.as_str())
                .chain(inputs.iter().map(String::as_str))
                .collect();
            let offset = ctx.e.op("Resize", &refs, attrs.clone());
            along_k = ctx.e.op("Sub", &[&along_k, &offset], vec![]);
        }
        // [in_k, out_k]: row i is what basis vector i becomes, i.e. A_k^T.
        let a_t = ctx.e.reshape(&along_k, &[n_in, n_out]);
        // Axis k last, contracted with A_k^T over out_k, and back.
        let mut perm: Vec<i64> = (0..rank as i64).filter(|&a| a != k as i64).collect();
        perm.push(k as i64);
        let mut back = vec![0i64; rank];
        for (i, &p) in perm.iter().enumerate() {
            back[p as usize] = i as i64;
        }
        let moved = ctx.e.op("Transpose", &[&g], vec![ints_attr("perm", &perm)]);
        let applied = ctx
            .e
            .matmul_t((&moved, rank), (&a_t, 2), false, true, 1.0, t);
        g = ctx
            .e
            .op("Transpose", &[&applied], vec![ints_attr("perm", &back)]);
    }
    let mut grads = vec![None; ctx.node.input.len()];
    grads[0] = Some(g);
    Ok(grads)
}

/// The constant float values of input `i` (`None` where absent).
fn constant_floats(ctx: &RuleCtx, i: usize) -> Result<Option<Vec<f64>>> {
    match ctx.input(i) {
        "" => Ok(None),
        name => match ctx.consts.get(name) {
            Some(s) => Ok(Some(s.to_f64_vec())),
            None => Err(ctx.unsupported(format!("input `{name}` must be a constant"))),
        },
    }
}

/// The Resize of the identity along axis `k` alone: its region, scales and sizes, for
/// the axes the node lists.
struct Along<'a> {
    listed: &'a [usize],
    k: usize,
    eye_shape: &'a [usize],
    n_out: usize,
}

impl Along<'_> {
    /// `[roi, scales, sizes]` (absent ones empty): the node's scale (or size) on axis
    /// `k`, 1 (the identity's own size) elsewhere; the node's region on `k`, all of
    /// every other axis.
    fn inputs(
        &self,
        ctx: &mut RuleCtx,
        scale: Option<f64>,
        roi: Option<&[f64]>,
    ) -> Result<Vec<String>> {
        let m = self.listed.len();
        let roi = match roi {
            Some(r) if r.len() == 2 * m => {
                let at = self.listed.iter().position(|&a| a == self.k).unwrap_or(0);
                let mut v = vec![0.0; 2 * m];
                v[m..].fill(1.0);
                v[at] = r[at];
                v[m + at] = r[m + at];
                ctx.e.constant(Tensor::f32(
                    vec![2 * m],
                    v.iter().map(|&x| x as f32).collect(),
                )?)
            }
            _ => String::new(),
        };
        Ok(match scale {
            Some(s) => {
                let v: Vec<f32> = self
                    .listed
                    .iter()
                    .map(|&a| if a == self.k { s as f32 } else { 1.0 })
                    .collect();
                let scales = ctx.e.constant(Tensor::f32(vec![m], v)?);
                vec![roi, scales]
            }
            None => {
                let v: Vec<i64> = self
                    .listed
                    .iter()
                    .map(|&a| match a == self.k {
                        true => self.n_out as i64,
                        false => self.eye_shape[a] as i64,
                    })
                    .collect();
                let sizes = ctx.e.ints(&v);
                vec![roi, String::new(), sizes]
            }
        })
    }
}

fn float(t: DType, shape: Vec<usize>, v: Vec<f64>) -> Result<Tensor> {
    match t {
        DType::F64 => Tensor::f64(shape, v),
        _ => Tensor::f32(shape, v.into_iter().map(|x| x as f32).collect()),
    }
}
