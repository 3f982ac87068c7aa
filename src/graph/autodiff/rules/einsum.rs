//! Einsum, any equation ONNX allows: any number of operands, an implicit or explicit
//! output, ellipses, indices repeated within an operand (diagonals, traces). Each
//! operand's gradient is again an Einsum, of `dY` with the other operands, into that
//! operand's distinct indices; then
//! - an index the operand sums alone (in neither `dY` nor another operand), or one it
//!   broadcasts (size 1 where the others have more), is put back with `Expand`;
//! - an index repeated within the operand is put back on the diagonal: one more Einsum
//!   with an identity of as many axes as the index appears.
//!
//! An ellipsis becomes explicit indices (letters the equation does not use), aligned from
//! the right as Einsum broadcasts them; an operand of size 1 on such an axis is expanded
//! before it enters another operand's gradient, so that every index has one size there.

use std::collections::BTreeSet;

use super::elementwise::{dtype, shape};
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_s, string_attr};
use crate::tensor::{DType, Tensor, TensorData};
use crate::Result;

/// An equation with every ellipsis written out: each operand's indices, the output's.
struct Equation {
    ops: Vec<Vec<char>>,
    out: Vec<char>,
}

impl Equation {
    /// `eq` for operands of these ranks; `None` where it is malformed.
    fn parse(eq: &str, ranks: &[usize]) -> Option<Equation> {
        let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
        let (lhs, out) = match eq.split_once("->") {
            Some((l, o)) => (l.to_string(), Some(o.to_string())),
            None => (eq.clone(), None),
        };
        let terms: Vec<&str> = lhs.split(',').collect();
        if terms.len() != ranks.len() {
            return None;
        }
        let used: BTreeSet<char> = eq.chars().filter(char::is_ascii_alphabetic).collect();
        let mut spare = ('a'..='z').chain('A'..='Z').filter(|c| !used.contains(c));
        let explicit = |t: &str| t.replace("...", "").chars().count();
        let widest = terms
            .iter()
            .zip(ranks)
            .filter(|(t, _)| t.contains("..."))
            .map(|(t, &r)| r.checked_sub(explicit(t)))
            .try_fold(0, |m, e| e.map(|e| m.max(e)))?;
        let fill: Vec<char> = (0..widest).map(|_| spare.next()).collect::<Option<_>>()?;
        let expand = |t: &str, rank: usize| -> Option<Vec<char>> {
            let e = rank.checked_sub(explicit(t))?;
            let with = t.replacen("...", &fill[widest - e..].iter().collect::<String>(), 1);
            let v: Vec<char> = with.chars().collect();
            (v.len() == rank && v.iter().all(char::is_ascii_alphabetic)).then_some(v)
        };
        let ops = terms
            .iter()
            .zip(ranks)
            .map(|(t, &r)| expand(t, r))
            .collect::<Option<Vec<_>>>()?;
        let out = match out {
            Some(o) => {
                let with = o.replacen("...", &fill.iter().collect::<String>(), 1);
                with.chars().collect()
            }
            // Implicit: the ellipsis, then every index that appears once, in order.
            None => {
                let all: Vec<char> = ops.iter().flatten().copied().collect();
                let once: BTreeSet<char> = all
                    .iter()
                    .filter(|c| !fill.contains(c) && all.iter().filter(|d| d == c).count() == 1)
                    .copied()
                    .collect();
                fill.iter().copied().chain(once).collect()
            }
        };
        Some(Equation { ops, out })
    }
}

/// Each index's size: the largest it has anywhere (broadcast axes have 1 elsewhere).
fn sizes(eqn: &Equation, shapes: &[Vec<usize>]) -> std::collections::HashMap<char, usize> {
    let mut sizes = std::collections::HashMap::new();
    for (op, s) in eqn.ops.iter().zip(shapes) {
        for (&c, &d) in op.iter().zip(s) {
            let e = sizes.entry(c).or_insert(d);
            *e = (*e).max(d);
        }
    }
    sizes
}

pub fn einsum(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let eq = attr_s(ctx.node, "equation").unwrap_or_default();
    let inputs: Vec<String> = ctx.node.input.clone();
    let shapes: Vec<Vec<usize>> = inputs
        .iter()
        .map(|i| shape(ctx, i))
        .collect::<Result<_>>()?;
    let ranks: Vec<usize> = shapes.iter().map(Vec::len).collect();
    let Some(eqn) = Equation::parse(&eq, &ranks) else {
        return Err(ctx.unsupported(format!("equation \"{eq}\" for operands of ranks {ranks:?}")));
    };
    let size = sizes(&eqn, &shapes);
    let t = dtype(ctx, ctx.output(0))?;
    (0..inputs.len())
        .map(|i| match ctx.needs(i) {
            true => operand_grad(ctx, &eqn, &size, (&inputs, &shapes), i, &dy, t).map(Some),
            false => Ok(None),
        })
        .collect()
}

/// The gradient of operand `i`.
fn operand_grad(
    ctx: &mut RuleCtx,
    eqn: &Equation,
    size: &std::collections::HashMap<char, usize>,
    (inputs, shapes): (&[String], &[Vec<usize>]),
    i: usize,
    dy: &str,
    t: DType,
) -> Result<String> {
    let mine = &eqn.ops[i];
    let mut distinct: Vec<char> = Vec::new();
    for &c in mine {
        if !distinct.contains(&c) {
            distinct.push(c);
        }
    }
    let my_size = |c: char| shapes[i][mine.iter().position(|&d| d == c).unwrap_or(0)];
    let seen: BTreeSet<char> = eqn
        .out
        .iter()
        .chain(
            eqn.ops
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .flat_map(|(_, o)| o),
        )
        .copied()
        .collect();
    let kept: Vec<char> = distinct
        .iter()
        .copied()
        .filter(|&c| seen.contains(&c) && my_size(c) == size[&c])
        .collect();
    // dY with every other operand, each at the full size of its indices.
    let mut terms = vec![eqn.out.iter().collect::<String>()];
    let mut operands = vec![dy.to_string()];
    for (j, o) in eqn.ops.iter().enumerate().filter(|&(j, _)| j != i) {
        let full: Vec<usize> = o.iter().map(|c| size[c]).collect();
        operands.push(match full == shapes[j] {
            true => inputs[j].clone(),
            false => {
                let s = ctx
                    .e
                    .ints(&full.iter().map(|&d| d as i64).collect::<Vec<_>>());
                ctx.e.op("Expand", &[&inputs[j], &s], vec![])
            }
        });
        terms.push(o.iter().collect());
    }
    let sub = format!("{}->{}", terms.join(","), kept.iter().collect::<String>());
    let refs: Vec<&str> = operands.iter().map(String::as_str).collect();
    let mut d = ctx
        .e
        .op("Einsum", &refs, vec![string_attr("equation", &sub)]);
    let distinct_shape: Vec<usize> = distinct.iter().map(|&c| my_size(c)).collect();
    if kept.len() != distinct.len() {
        let ones: Vec<usize> = distinct
            .iter()
            .map(|&c| if kept.contains(&c) { my_size(c) } else { 1 })
            .collect();
        let r = ctx.e.reshape(&d, &ones);
        let s = ctx
            .e
            .ints(&distinct_shape.iter().map(|&x| x as i64).collect::<Vec<_>>());
        d = ctx.e.op("Expand", &[&r, &s], vec![]);
    }
    if distinct.len() != mine.len() {
        d = on_diagonals(ctx, &d, &distinct, mine, &distinct_shape, t)?;
    }
    Ok(d)
}

/// `d` (indices `distinct`) written onto the diagonals of an operand whose indices
/// `mine` repeat some of them: `Einsum(d, I_c, ...)` with an identity for each repeated
/// index over its repeats' renamed axes.
fn on_diagonals(
    ctx: &mut RuleCtx,
    d: &str,
    distinct: &[char],
    mine: &[char],
    distinct_shape: &[usize],
    t: DType,
) -> Result<String> {
    let used: BTreeSet<char> = distinct.iter().copied().collect();
    let mut spare = ('a'..='z').chain('A'..='Z').filter(|c| !used.contains(c));
    let mut renamed = Vec::with_capacity(mine.len());
    let mut deltas: Vec<(String, usize, usize)> = Vec::new(); // (indices, size, ways)
    for (k, &c) in distinct.iter().enumerate() {
        let ways = mine.iter().filter(|&&m| m == c).count();
        if ways > 1 {
            let fresh: Vec<char> = (1..ways).filter_map(|_| spare.next()).collect();
            deltas.push((
                std::iter::once(c).chain(fresh.iter().copied()).collect(),
                distinct_shape[k],
                ways,
            ));
        }
    }
    let mut next: std::collections::HashMap<char, usize> = std::collections::HashMap::new();
    for &c in mine {
        let n = next.entry(c).or_insert(0);
        let letter = deltas
            .iter()
            .find(|(s, _, _)| s.starts_with(c))
            .map_or(c, |(s, _, _)| s.chars().nth(*n).unwrap_or(c));
        *n += 1;
        renamed.push(letter);
    }
    let mut terms = vec![distinct.iter().collect::<String>()];
    let mut operands = vec![d.to_string()];
    for (subs, n, ways) in &deltas {
        operands.push(ctx.e.constant(identity(*n, *ways, t)?));
        terms.push(subs.clone());
    }
    let sub = format!(
        "{}->{}",
        terms.join(","),
        renamed.iter().collect::<String>()
    );
    let refs: Vec<&str> = operands.iter().map(String::as_str).collect();
    Ok(ctx
        .e
        .op("Einsum", &refs, vec![string_attr("equation", &sub)]))
}

/// The `ways`-axis identity of size `n`: 1 where every index is equal.
fn identity(n: usize, ways: usize, t: DType) -> Result<Tensor> {
    let total = n.pow(ways as u32);
    let step: usize = (0..ways).map(|k| n.pow(k as u32)).sum();
    let v: Vec<f64> = (0..total)
        .map(|i| if i % step == 0 { 1.0 } else { 0.0 })
        .collect();
    let data = match t {
        DType::F64 => TensorData::F64(v),
        _ => TensorData::F32(v.iter().map(|&x| x as f32).collect()),
    };
    Tensor::new(vec![n; ways], data)
}
