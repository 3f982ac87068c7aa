//! The gradient of `Resize`. Resize (nearest, linear or cubic, with any coordinate
//! transformation but `tf_crop_and_resize`) is linear in X and works axis by axis:
//! along each resized axis `k`, `Y = A_k X` with `A_k` the `[out_k, in_k]` interpolation
//! matrix. Its adjoint applies each `A_k^T` to dY. `A_k` comes from the same Resize run on
//! an identity (basis vectors stacked on axis 0, resized along `k` alone), so dX follows
//! exactly the interpolation ONNX Runtime computed, whatever its mode and rounding.

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_s, ints_attr};
use crate::tensor::{DType, Tensor};
use crate::Result;

pub fn resize(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let (sx, sy) = (shape(ctx, &x)?, shape(ctx, ctx.output(0))?);
    let t = dtype(ctx, &x)?;
    if attr_s(ctx.node, "coordinate_transformation_mode").as_deref() == Some("tf_crop_and_resize") {
        return Err(ctx.unsupported("coordinate_transformation_mode=tf_crop_and_resize"));
    }
    if ctx.node.attribute.iter().any(|a| a.name == "axes") {
        return Err(ctx.unsupported("the axes attribute (give scales or sizes for every axis)"));
    }
    let scales: Option<Vec<f64>> = match ctx.input(2) {
        "" => None,
        name => match ctx.consts.get(name) {
            Some(s) if !s.is_empty() => Some(s.to_f64_vec()),
            Some(_) => None,
            None => return Err(ctx.unsupported(format!("scales `{name}` must be a constant"))),
        },
    };
    let rank = sx.len();
    let resized: Vec<usize> = (0..rank)
        .filter(|&k| sx[k] != sy[k] || scales.as_ref().is_some_and(|s| s[k] != 1.0))
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
        let eye = ctx.e.constant(float(t, eye_shape, v)?);
        let along_k = match &scales {
            Some(s) => {
                let mut one = vec![1.0; rank];
                one[k] = s[k];
                let scales = ctx.e.constant(Tensor::f32(
                    vec![rank],
                    one.iter().map(|&x| x as f32).collect(),
                )?);
                ctx.e.op("Resize", &[&eye, "", &scales], attrs.clone())
            }
            None => {
                let mut sizes = vec![1; rank];
                sizes[0] = n_in as i64;
                sizes[k] = n_out as i64;
                let sizes = ctx.e.ints(&sizes);
                ctx.e.op("Resize", &[&eye, "", "", &sizes], attrs.clone())
            }
        };
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

fn float(t: DType, shape: Vec<usize>, v: Vec<f64>) -> Result<Tensor> {
    match t {
        DType::F64 => Tensor::f64(shape, v),
        _ => Tensor::f32(shape, v.into_iter().map(|x| x as f32).collect()),
    }
}
