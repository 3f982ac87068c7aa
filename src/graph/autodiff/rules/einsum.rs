//! Einsum of one or two operands, explicit output, no ellipsis and no index repeated
//! within one operand: each operand's gradient is again an Einsum, of `dY` with the other
//! operand, into that operand's subscripts (an index the operand sums alone, found in
//! neither `dY` nor the other operand, is broadcast back with `Expand`).

use super::elementwise::shape;
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_s, string_attr};
use crate::Result;

/// The operands' and the output's subscripts, when the equation is of the supported form.
fn parse(eq: &str) -> Option<(Vec<String>, String)> {
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, out) = eq.split_once("->")?;
    let ops: Vec<String> = lhs.split(',').map(str::to_string).collect();
    let plain = |s: &str| {
        s.chars().all(|c| c.is_ascii_alphabetic())
            && s.chars().collect::<std::collections::HashSet<_>>().len() == s.len()
    };
    (ops.len() <= 2 && ops.iter().all(|o| plain(o)) && plain(out)).then(|| (ops, out.to_string()))
}

pub fn einsum(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let eq = attr_s(ctx.node, "equation").unwrap_or_default();
    let Some((ops, out)) = parse(&eq) else {
        return Err(ctx.unsupported(format!(
            "equation \"{eq}\" (one or two operands, an explicit output, no ellipsis or \
             repeated index are supported)"
        )));
    };
    let mut g = vec![None; ops.len()];
    for i in 0..ops.len() {
        if !ctx.needs(i) {
            continue;
        }
        let mine = &ops[i];
        let other = ops.get(1 - i).filter(|_| ops.len() == 2);
        let seen: String = out
            .chars()
            .chain(other.into_iter().flat_map(|o| o.chars()))
            .collect();
        let kept: String = mine.chars().filter(|c| seen.contains(*c)).collect();
        let (inputs, sub) = match other {
            Some(o) => (
                vec![dy.clone(), ctx.input(1 - i).to_string()],
                format!("{out},{o}->{kept}"),
            ),
            None => (vec![dy.clone()], format!("{out}->{kept}")),
        };
        let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
        let d = ctx
            .e
            .op("Einsum", &refs, vec![string_attr("equation", &sub)]);
        g[i] = Some(if kept.len() == mine.len() {
            d
        } else {
            // Indices summed by this operand alone: reshape with ones there, then expand.
            let sx = shape(ctx, ctx.input(i))?;
            let ones: Vec<usize> = mine
                .chars()
                .zip(&sx)
                .map(|(c, &d)| if kept.contains(c) { d } else { 1 })
                .collect();
            let r = ctx.e.reshape(&d, &ones);
            let s = ctx
                .e
                .ints(&sx.iter().map(|&d| d as i64).collect::<Vec<_>>());
            ctx.e.op("Expand", &[&r, &s], vec![])
        });
    }
    Ok(g)
}
