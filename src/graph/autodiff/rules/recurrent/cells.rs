//! Each cell's backward over one direction (ONNX's gate orders: LSTM `i o f c`, GRU
//! `z r h`). The factors that depend on the forward alone are computed for all steps
//! at once; the loop carries `dh` (and an LSTM's `dc`) from the last step to the first.

use super::{Cell, CellGrads, Dims, Direction};
use crate::graph::autodiff::emit::Emitter;

pub(super) fn backward(e: &mut Emitter, d: &Dims, cell: Cell, dir: &Direction) -> CellGrads {
    match cell {
        Cell::Lstm => lstm(e, d, dir),
        Cell::Gru {
            linear_before_reset: true,
        } => gru_linear_before_reset(e, d, dir),
        Cell::Gru {
            linear_before_reset: false,
        } => gru(e, d, dir),
        Cell::Rnn { relu } => rnn(e, d, dir, relu),
    }
}

/// Small helpers over one emitter and element type.
struct Ops<'a> {
    e: &'a mut Emitter,
    d: &'a Dims,
}

impl Ops<'_> {
    fn op(&mut self, op: &str, inputs: &[&str]) -> String {
        self.e.op(op, inputs, vec![])
    }
    fn mul(&mut self, a: &str, b: &str) -> String {
        self.e.mul(a, b)
    }
    fn add(&mut self, a: &str, b: &str) -> String {
        self.op("Add", &[a, b])
    }
    /// `1 - x`.
    fn one_minus(&mut self, x: &str) -> String {
        let one = self.e.scalar(1.0, self.d.dtype);
        self.op("Sub", &[&one, x])
    }
    /// `s (1 - s)`: the sigmoid's derivative from its output.
    fn sigmoid_slope(&mut self, s: &str) -> String {
        let c = self.one_minus(s);
        self.mul(s, &c)
    }
    /// `1 - t^2`: tanh's derivative from its output.
    fn tanh_slope(&mut self, t: &str) -> String {
        let sq = self.mul(t, t);
        self.one_minus(&sq)
    }
    /// `x @ w^T` over `[T, B, K]` and `[N, K]`, plus `bias` where given.
    fn affine(&mut self, x: &str, w: &str, bias: Option<&str>) -> String {
        let y = self
            .e
            .matmul_t((x, 3), (w, 2), false, true, 1.0, self.d.dtype);
        match bias {
            Some(b) => self.add(&y, b),
            None => y,
        }
    }
    /// `x` split into its `n` gates on the last axis.
    fn gates(&mut self, x: &str, n: usize) -> Vec<String> {
        self.e.split(x, 2, &vec![self.d.hidden; n])
    }
    /// `x` split into its `T` steps, each `[1, B, ...]`.
    fn steps(&mut self, x: &str) -> Vec<String> {
        self.e.split(x, 0, &vec![1; self.d.seq])
    }
    /// `a + b` where either may be absent (zero).
    fn add_opt(&mut self, a: Option<&String>, b: Option<&String>) -> Option<String> {
        match (a, b) {
            (Some(a), Some(b)) => Some(self.add(a, b)),
            (one, other) => one.or(other).cloned(),
        }
    }
    /// `dh[t]`: the gradient from `Y[t]` plus the one carried from step `t + 1`.
    fn dh_at(&mut self, dys: &Option<Vec<String>>, t: usize, carried: Option<&String>) -> String {
        let from_y = dys.as_ref().map(|v| &v[t]);
        match self.add_opt(from_y, carried) {
            Some(dh) => dh,
            None => self
                .e
                .zeros(&[1, self.d.batch, self.d.hidden], self.d.dtype),
        }
    }
    /// `parts` (computed last step first) joined in time order.
    fn in_time_order(&mut self, mut parts: Vec<String>) -> String {
        parts.reverse();
        self.e.concat(&parts, 0)
    }
    /// A GRU's gates from their pre-activations `z, r` and the candidate's, less
    /// what `r` scales: `(z, r, n)` and the factors `kz = (h[t-1] - n) z'` and
    /// `kn = (1 - z) n'` that turn `dh` into the update gate's and the candidate's
    /// pre-activation gradients.
    fn gru_gates(
        &mut self,
        [az, ar]: [&str; 2],
        h_prev: &str,
        scaled: impl FnOnce(&mut Self, &str) -> String,
    ) -> GruGates {
        let (z, r) = (self.op("Sigmoid", &[az]), self.op("Sigmoid", &[ar]));
        let an = scaled(self, &r);
        let n = self.op("Tanh", &[&an]);
        let (sz, sn) = (self.sigmoid_slope(&z), self.tanh_slope(&n));
        let diff = self.op("Sub", &[h_prev, &n]);
        let kz = self.mul(&diff, &sz);
        let one_z = self.one_minus(&z);
        let kn = self.mul(&one_z, &sn);
        GruGates { z, r, kz, kn }
    }
}

/// What both forms of GRU share of their gates (see [`Ops::gru_gates`]).
struct GruGates {
    z: String,
    r: String,
    kz: String,
    kn: String,
}

/// The biases of both sides summed (`None` when the node has none).
fn bias(o: &mut Ops, dir: &Direction) -> Option<String> {
    match (&dir.wb, &dir.rb) {
        (Some(w), Some(r)) => Some(o.add(w, r)),
        _ => None,
    }
}

/// `i, o, f = sigmoid`, `g = tanh` of `X W^T + h R^T + b`; `c[t] = f c[t-1] + i g`,
/// `h[t] = o tanh(c[t])`.
fn lstm(e: &mut Emitter, d: &Dims, dir: &Direction) -> CellGrads {
    let mut o = Ops { e, d };
    let b = bias(&mut o, dir);
    let xw = o.affine(&dir.x, &dir.w, b.as_deref());
    let a = o.affine(&dir.h_prev, &dir.r, None);
    let a = o.add(&xw, &a);
    let pre = o.gates(&a, 4);
    let (i, og, f) = (
        o.op("Sigmoid", &[&pre[0]]),
        o.op("Sigmoid", &[&pre[1]]),
        o.op("Sigmoid", &[&pre[2]]),
    );
    let g = o.op("Tanh", &[&pre[3]]);

    // The cell states, one step at a time (`c[-1]` is the initial state, or zero).
    let ig = o.mul(&i, &g);
    let (fs, igs) = (o.steps(&f), o.steps(&ig));
    let mut cs: Vec<String> = Vec::with_capacity(d.seq);
    for t in 0..d.seq {
        let prev = cs.last().or(dir.c0.as_ref()).cloned();
        cs.push(match prev {
            Some(p) => {
                let kept = o.mul(&fs[t], &p);
                o.add(&kept, &igs[t])
            }
            None => igs[t].clone(),
        });
    }
    let c0 = dir
        .c0
        .clone()
        .unwrap_or_else(|| o.e.zeros(&[1, d.batch, d.hidden], d.dtype));
    let mut before = vec![c0];
    before.extend_from_slice(&cs[..d.seq - 1]);
    let c_prev = o.e.concat(&before, 0);
    let c = o.e.concat(&cs, 0);
    let tc = o.op("Tanh", &[&c]);

    // dc[t] = dc[t+1] f[t+1] + dh[t] o (1 - tc^2); the gates' pre-activations get
    // [dc g i', dh tc o', dc c[t-1] f', dc i g'] = [dc, dh, dc, dc] * k.
    let slope_c = o.tanh_slope(&tc);
    let to_c = o.mul(&og, &slope_c);
    let k = {
        let (si, so, sf, sg) = (
            o.sigmoid_slope(&i),
            o.sigmoid_slope(&og),
            o.sigmoid_slope(&f),
            o.tanh_slope(&g),
        );
        let ki = o.mul(&g, &si);
        let ko = o.mul(&tc, &so);
        let kf = o.mul(&c_prev, &sf);
        let kg = o.mul(&i, &sg);
        o.e.concat(&[ki, ko, kf, kg], 2)
    };
    let (to_cs, ks) = (o.steps(&to_c), o.steps(&k));
    let dys = dir.dy.as_ref().map(|dy| o.steps(dy));
    let (mut dh, mut dc) = (dir.dy_last.clone(), dir.dc_last.clone());
    let mut das = Vec::with_capacity(d.seq);
    for t in (0..d.seq).rev() {
        let dh_t = o.dh_at(&dys, t, dh.as_ref());
        let via_h = o.mul(&dh_t, &to_cs[t]);
        let dc_t = match &dc {
            Some(carried) => o.add(carried, &via_h),
            None => via_h,
        };
        let spread =
            o.e.concat(&[dc_t.clone(), dh_t, dc_t.clone(), dc_t.clone()], 2);
        let da = o.mul(&spread, &ks[t]);
        dc = Some(o.mul(&dc_t, &fs[t]));
        dh = Some(o.e.matmul_t((&da, 3), (&dir.r, 2), false, false, 1.0, d.dtype));
        das.push(da);
    }
    let da = o.in_time_order(das);
    CellGrads {
        dr: vec![(da.clone(), dir.h_prev.clone())],
        da_x: da,
        drb: None,
        dh0: dh.expect("one step at least"),
        dc0: dc,
    }
}

/// PyTorch's GRU: `z, r = sigmoid(X W^T + h R^T + b)`,
/// `n = tanh(X Wn^T + Wbn + r (h Rn^T + Rbn))`, `h[t] = (1 - z) n + z h[t-1]`.
fn gru_linear_before_reset(e: &mut Emitter, d: &Dims, dir: &Direction) -> CellGrads {
    let mut o = Ops { e, d };
    let xw = o.affine(&dir.x, &dir.w, dir.wb.as_deref());
    let hr = o.affine(&dir.h_prev, &dir.r, dir.rb.as_deref());
    let (xs, hs) = (o.gates(&xw, 3), o.gates(&hr, 3));
    let az = o.add(&xs[0], &hs[0]);
    let ar = o.add(&xs[1], &hs[1]);
    let q = &hs[2];
    let GruGates { z, r, kz, kn } = o.gru_gates([&az, &ar], &dir.h_prev, |o, r| {
        let rq = o.mul(r, q);
        o.add(&xs[2], &rq)
    });

    // The recurrence side gets [dh kz, dh kr, dh kn r] = dh * [kz, kr, kq].
    let sr = o.sigmoid_slope(&r);
    let knq = o.mul(&kn, q);
    let kr = o.mul(&knq, &sr);
    let kq = o.mul(&kn, &r);
    let k = o.e.concat(&[kz.clone(), kr.clone(), kq], 2);
    let (ks, zs) = (o.steps(&k), o.steps(&z));
    let dys = dir.dy.as_ref().map(|dy| o.steps(dy));
    let mut dh = dir.dy_last.clone();
    let (mut dhs, mut gs) = (Vec::with_capacity(d.seq), Vec::with_capacity(d.seq));
    for t in (0..d.seq).rev() {
        let dh_t = o.dh_at(&dys, t, dh.as_ref());
        let spread = o.e.concat(&[dh_t.clone(), dh_t.clone(), dh_t.clone()], 2);
        let g = o.mul(&spread, &ks[t]);
        let direct = o.mul(&dh_t, &zs[t]);
        let through_r =
            o.e.matmul_t((&g, 3), (&dir.r, 2), false, false, 1.0, d.dtype);
        dh = Some(o.add(&direct, &through_r));
        dhs.push(dh_t);
        gs.push(g);
    }
    let dh_all = o.in_time_order(dhs);
    let g = o.in_time_order(gs);
    let (dz, dr_gate, dn) = (
        o.mul(&dh_all, &kz),
        o.mul(&dh_all, &kr),
        o.mul(&dh_all, &kn),
    );
    let da_x = o.e.concat(&[dz, dr_gate, dn], 2);
    CellGrads {
        da_x,
        dr: vec![(g.clone(), dir.h_prev.clone())],
        drb: Some(g),
        dh0: dh.expect("one step at least"),
        dc0: None,
    }
}

/// ONNX's default GRU: `n = tanh(X Wn^T + (r h) Rn^T + Rbn + Wbn)`.
fn gru(e: &mut Emitter, d: &Dims, dir: &Direction) -> CellGrads {
    let mut o = Ops { e, d };
    let h = d.hidden;
    let b = bias(&mut o, dir);
    let xw = o.affine(&dir.x, &dir.w, b.as_deref());
    let xs = o.gates(&xw, 3);
    let rs = o.e.split(&dir.r, 0, &[2 * h, h]);
    let (r_zr, r_n) = (&rs[0], &rs[1]);
    let hzr = o.affine(&dir.h_prev, r_zr, None);
    let hs = o.gates(&hzr, 2);
    let az = o.add(&xs[0], &hs[0]);
    let ar = o.add(&xs[1], &hs[1]);
    let mut p = String::new();
    let GruGates { z, r, kz, kn } = o.gru_gates([&az, &ar], &dir.h_prev, |o, r| {
        p = o.mul(r, &dir.h_prev);
        let pn = o.affine(&p, r_n, None);
        o.add(&xs[2], &pn)
    });

    // dn's pre-activation dh kn; dp = (dh kn) Rn; r's pre-activation dp h r'.
    let sr = o.sigmoid_slope(&r);
    let kr = o.mul(&dir.h_prev, &sr);
    let (kzs, kns, krs) = (o.steps(&kz), o.steps(&kn), o.steps(&kr));
    let (zs, rsteps) = (o.steps(&z), o.steps(&r));
    let dys = dir.dy.as_ref().map(|dy| o.steps(dy));
    let mut dh = dir.dy_last.clone();
    let (mut zrs, mut dns) = (Vec::with_capacity(d.seq), Vec::with_capacity(d.seq));
    for t in (0..d.seq).rev() {
        let dh_t = o.dh_at(&dys, t, dh.as_ref());
        let dn = o.mul(&dh_t, &kns[t]);
        let dp = o.e.matmul_t((&dn, 3), (r_n, 2), false, false, 1.0, d.dtype);
        let dz = o.mul(&dh_t, &kzs[t]);
        let dr_gate = o.mul(&dp, &krs[t]);
        let zr = o.e.concat(&[dz, dr_gate], 2);
        let direct = o.mul(&dh_t, &zs[t]);
        let through_p = o.mul(&dp, &rsteps[t]);
        let through_zr =
            o.e.matmul_t((&zr, 3), (r_zr, 2), false, false, 1.0, d.dtype);
        let sum = o.add(&direct, &through_p);
        dh = Some(o.add(&sum, &through_zr));
        zrs.push(zr);
        dns.push(dn);
    }
    let zr = o.in_time_order(zrs);
    let dn = o.in_time_order(dns);
    let da_x = o.e.concat(&[zr.clone(), dn.clone()], 2);
    CellGrads {
        da_x,
        dr: vec![(zr, dir.h_prev.clone()), (dn, p)],
        drb: None,
        dh0: dh.expect("one step at least"),
        dc0: None,
    }
}

/// `h[t] = act(X W^T + h[t-1] R^T + b)`: the slope is read from `h[t]` itself.
fn rnn(e: &mut Emitter, d: &Dims, dir: &Direction, relu: bool) -> CellGrads {
    let mut o = Ops { e, d };
    let slope = match relu {
        true => o.op("Sign", &[&dir.y]),
        false => o.tanh_slope(&dir.y),
    };
    let slopes = o.steps(&slope);
    let dys = dir.dy.as_ref().map(|dy| o.steps(dy));
    let mut dh = dir.dy_last.clone();
    let mut das = Vec::with_capacity(d.seq);
    for t in (0..d.seq).rev() {
        let dh_t = o.dh_at(&dys, t, dh.as_ref());
        let da = o.mul(&dh_t, &slopes[t]);
        dh = Some(o.e.matmul_t((&da, 3), (&dir.r, 2), false, false, 1.0, d.dtype));
        das.push(da);
    }
    let da = o.in_time_order(das);
    CellGrads {
        dr: vec![(da.clone(), dir.h_prev.clone())],
        da_x: da,
        drb: None,
        dh0: dh.expect("one step at least"),
        dc0: None,
    }
}
