//! Pad, in every mode. Each output position reads one input position (or the constant):
//! the gradient adds `dY` back at the position read.
//! - `constant`: `dY` padded by the negated pads (what was added is cut off, what was cut
//!   off comes back as zeros); the constant's own gradient is what `dY` holds beyond that.
//! - `reflect`, `edge`, `wrap`, axis by axis: the middle of `dY` where the input was, plus
//!   each padded strip added where it was read from: mirrored next to the edge (reflect),
//!   summed onto the edge (edge), or at the other end (wrap).

use super::elementwise::shape;
use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::graph::ir::{attr_ints, attr_s, int_attr};
use crate::Result;

pub fn pad(ctx: &mut RuleCtx) -> Result<Grads> {
    let dy = ctx.dy(0)?;
    let x = ctx.input(0).to_string();
    let sx = shape(ctx, &x)?;
    let rank = sx.len();
    let mode = attr_s(ctx.node, "mode").unwrap_or_else(|| "constant".into());
    let pads = match ctx.opset >= 11 {
        true => ctx.const_ints(1)?.unwrap_or_default(),
        false => attr_ints(ctx.node, "pads").unwrap_or_default(),
    };
    let axes: Vec<usize> = match ctx.const_ints(3)? {
        Some(a) => a
            .iter()
            .map(|&v| (if v < 0 { v + rank as i64 } else { v }) as usize)
            .collect(),
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(ctx.unsupported(format!("pads {pads:?}: not one pair per axis")));
    }
    let k = axes.len();
    let mut full = vec![0i64; 2 * rank];
    for (i, &a) in axes.iter().enumerate() {
        full[a] = pads[i];
        full[rank + a] = pads[k + i];
    }
    let mut g = vec![None; ctx.node.input.len()];
    if mode == "constant" {
        let negated: Vec<i64> = full.iter().map(|&p| -p).collect();
        let p = ctx.e.ints(&negated);
        let dx = ctx.e.op("Pad", &[&dy, &p], vec![]);
        if ctx.needs(2) {
            let all = ctx.e.op("ReduceSum", &[&dy], vec![int_attr("keepdims", 0)]);
            let kept = ctx.e.op("ReduceSum", &[&dx], vec![int_attr("keepdims", 0)]);
            g[2] = Some(ctx.e.op("Sub", &[&all, &kept], vec![]));
        }
        g[0] = Some(dx);
        return Ok(g);
    }
    if full.iter().any(|&p| p < 0) {
        return Err(ctx.unsupported(format!("negative pads in {mode} mode")));
    }
    let mut dx = dy;
    for a in (0..rank).filter(|&a| full[a] != 0 || full[rank + a] != 0) {
        let fold = Fold {
            axis: a,
            before: full[a],
            after: full[rank + a],
            n: sx[a] as i64,
            rank,
        };
        dx = fold.back(ctx, &dx, &mode)?;
    }
    g[0] = Some(dx);
    Ok(g)
}

/// One padded axis of a non-constant Pad, folded back onto the input's positions.
struct Fold {
    axis: usize,
    before: i64,
    after: i64,
    /// The input's length on the axis.
    n: i64,
    rank: usize,
}

impl Fold {
    fn back(&self, ctx: &mut RuleCtx, g: &str, mode: &str) -> Result<String> {
        let (pb, pe, n) = (self.before, self.after, self.n);
        let fits = match mode {
            "reflect" => pb < n && pe < n,
            "wrap" => pb <= n && pe <= n,
            "edge" => true,
            other => return Err(ctx.unsupported(format!("mode=\"{other}\""))),
        };
        if !fits {
            return Err(ctx.unsupported(format!(
                "{mode} pads ({pb}, {pe}) longer than the axis ({n})"
            )));
        }
        let mut sum = self.part(ctx, g, pb, pb + n);
        if pb > 0 {
            let strip = self.part(ctx, g, 0, pb);
            let back = match mode {
                "reflect" => {
                    let r = self.reversed(ctx, &strip);
                    self.placed(ctx, &r, 1, n - 1 - pb)
                }
                "edge" => {
                    let s = ctx.e.reduce_sum(&strip, &[self.axis as i64], true);
                    self.placed(ctx, &s, 0, n - 1)
                }
                _ => self.placed(ctx, &strip, n - pb, 0),
            };
            sum = ctx.e.op("Add", &[&sum, &back], vec![]);
        }
        if pe > 0 {
            let strip = self.part(ctx, g, pb + n, pb + n + pe);
            let back = match mode {
                "reflect" => {
                    let r = self.reversed(ctx, &strip);
                    self.placed(ctx, &r, n - 1 - pe, 1)
                }
                "edge" => {
                    let s = ctx.e.reduce_sum(&strip, &[self.axis as i64], true);
                    self.placed(ctx, &s, n - 1, 0)
                }
                _ => self.placed(ctx, &strip, 0, n - pe),
            };
            sum = ctx.e.op("Add", &[&sum, &back], vec![]);
        }
        Ok(sum)
    }

    /// Positions `[from, to)` of `g` on the axis.
    fn part(&self, ctx: &mut RuleCtx, g: &str, from: i64, to: i64) -> String {
        let (s, e) = (ctx.e.ints(&[from]), ctx.e.ints(&[to]));
        let a = ctx.e.ints(&[self.axis as i64]);
        ctx.e.op("Slice", &[g, &s, &e, &a], vec![])
    }

    /// `g` reversed on the axis.
    fn reversed(&self, ctx: &mut RuleCtx, g: &str) -> String {
        let (s, e) = (ctx.e.ints(&[-1]), ctx.e.ints(&[i64::MIN]));
        let (a, st) = (ctx.e.ints(&[self.axis as i64]), ctx.e.ints(&[-1]));
        ctx.e.op("Slice", &[g, &s, &e, &a, &st], vec![])
    }

    /// `g` with `before` and `after` zeros on the axis.
    fn placed(&self, ctx: &mut RuleCtx, g: &str, before: i64, after: i64) -> String {
        let mut pads = vec![0i64; 2 * self.rank];
        pads[self.axis] = before;
        pads[self.rank + self.axis] = after;
        let p = ctx.e.ints(&pads);
        ctx.e.op("Pad", &[g, &p], vec![])
    }
}
