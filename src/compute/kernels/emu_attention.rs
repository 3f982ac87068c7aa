//! Attention's plan on the CPU ([`super::emu`]): the products as cuBLAS defines them,
//! on the views the CPU kernel reads, and `attention.cu`'s row kernels, against float64.

use super::emu::Emulator;
use super::emu_tests::{at, bits, close, to, wave};
use super::*;
use crate::compute::fused::View;

/// One attention case: the tensors' views (from the CPU kernel's layouts), values and a
/// float64 reference of the forward and backward.
pub(super) struct AttentionCase {
    pub(super) dims: [usize; 5], // B, H, T, S, D (= E)
    pub(super) causal: bool,
    pub(super) scale: f32,
    /// q, kt, v: (tensor index, view); one tensor when packed.
    pub(super) views: [(usize, View); 3],
    pub(super) out: View,
    pub(super) out_len: usize,
    pub(super) tensors: Vec<Vec<f32>>,
    /// An additive mask: its values and strides over `[B, H, T, S]`.
    pub(super) mask: Option<(Vec<f32>, [usize; 4])>,
}

/// The reference's results: P, O, the tensors' gradients and each query row's
/// log-sum-exp of its scores.
pub(super) type Reference = (Vec<f64>, Vec<f64>, Vec<Vec<f64>>, Vec<f64>);

impl AttentionCase {
    fn value(&self, i: usize, [b, h, r, c]: [usize; 4]) -> f64 {
        let (t, v) = self.views[i];
        let at =
            v.offset + b * v.strides[0] + h * v.strides[1] + r * v.strides[2] + c * v.strides[3];
        self.tensors[t][at] as f64
    }

    /// The mask's value at (b, h, i, j), 0 without one.
    fn masked(&self, at: [usize; 4]) -> f64 {
        let Some((values, strides)) = &self.mask else {
            return 0.0;
        };
        values[(0..4).map(|a| at[a] * strides[a]).sum::<usize>()] as f64
    }

    fn index(v: &View, [b, h, r, c]: [usize; 4]) -> usize {
        v.offset + b * v.strides[0] + h * v.strides[1] + r * v.strides[2] + c * v.strides[3]
    }

    /// P, O, the gradients of the tensors for `d_o` (in O's layout) and the rows'
    /// log-sum-exps, in float64.
    pub(super) fn reference(&self, d_o: &[f32]) -> Reference {
        let [bn, hn, t, s, d] = self.dims;
        let mut p = vec![0f64; bn * hn * t * s];
        let mut lse = vec![0f64; bn * hn * t];
        let mut o = vec![0f64; self.out_len];
        let mut grads: Vec<Vec<f64>> = self.tensors.iter().map(|x| vec![0.0; x.len()]).collect();
        for b in 0..bn {
            for h in 0..hn {
                let pp = |i: usize, j: usize| ((b * hn + h) * t + i) * s + j;
                for i in 0..t {
                    let seen = if self.causal { i + s - t + 1 } else { s };
                    let sc: Vec<f64> = (0..seen)
                        .map(|j| {
                            self.scale as f64
                                * (0..d)
                                    .map(|e| {
                                        self.value(0, [b, h, i, e]) * self.value(1, [b, h, e, j])
                                    })
                                    .sum::<f64>()
                                + self.masked([b, h, i, j])
                        })
                        .collect();
                    let top = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let total: f64 = sc.iter().map(|x| (x - top).exp()).sum();
                    lse[(b * hn + h) * t + i] = top + total.ln();
                    (0..seen).for_each(|j| p[pp(i, j)] = (sc[j] - top).exp() / total);
                    for e in 0..d {
                        let at = Self::index(&self.out, [b, h, i, e]);
                        o[at] = (0..s)
                            .map(|j| p[pp(i, j)] * self.value(2, [b, h, j, e]))
                            .sum();
                    }
                }
                let dov = |i: usize, e: usize| d_o[Self::index(&self.out, [b, h, i, e])] as f64;
                let mut ds = vec![0f64; t * s];
                for i in 0..t {
                    let dp: Vec<f64> = (0..s)
                        .map(|j| {
                            (0..d)
                                .map(|e| dov(i, e) * self.value(2, [b, h, j, e]))
                                .sum()
                        })
                        .collect();
                    let dot: f64 = (0..s).map(|j| dp[j] * p[pp(i, j)]).sum();
                    (0..s).for_each(|j| {
                        ds[i * s + j] = self.scale as f64 * p[pp(i, j)] * (dp[j] - dot)
                    });
                }
                for e in 0..d {
                    for j in 0..s {
                        let (tv, vv) = self.views[2];
                        grads[tv][Self::index(&vv, [b, h, j, e])] +=
                            (0..t).map(|i| p[pp(i, j)] * dov(i, e)).sum::<f64>();
                        let (tk, kv) = self.views[1];
                        grads[tk][Self::index(&kv, [b, h, e, j])] += (0..t)
                            .map(|i| self.value(0, [b, h, i, e]) * ds[i * s + j])
                            .sum::<f64>();
                    }
                    for i in 0..t {
                        let (tq, qv) = self.views[0];
                        grads[tq][Self::index(&qv, [b, h, i, e])] += (0..s)
                            .map(|j| ds[i * s + j] * self.value(1, [b, h, e, j]))
                            .sum::<f64>();
                    }
                }
            }
        }
        (p, o, grads, lse)
    }

    /// Buffers for O and the gradients of the tensors, NaN until a plan writes them.
    pub(super) fn outputs(&self) -> (Vec<f32>, Vec<Vec<f32>>) {
        let o = vec![f32::NAN; self.out_len];
        let grads = self.tensors.iter().map(|x| vec![f32::NAN; x.len()]);
        (o, grads.collect())
    }

    /// q, kt and v's matrices in the tensors (or their gradients) at `bases`.
    pub(super) fn mats(&self, bases: &[u64]) -> [Mat; 3] {
        [0, 1, 2].map(|i| Mat::of(&self.views[i].1, bases[self.views[i].0]))
    }

    /// Where a forward plan reads the case's tensors and writes O (`o`) and what it keeps
    /// (`kept`: P, or each row's log-sum-exp).
    pub(super) fn at(&self, o: &mut [f32], kept: &mut [f32]) -> AttentionAt {
        let bases: Vec<u64> = self.tensors.iter().map(|x| at(x)).collect();
        let [q, kt, v] = self.mats(&bases);
        AttentionAt {
            batch: self.dims[0],
            heads: self.dims[1],
            q,
            kt,
            v,
            o: Mat::of(&self.out, to(o)),
            p: to(kept),
            mask: self.mask.as_ref().map(|(v, strides)| (at(v), *strides)),
        }
    }

    /// The gradients' matrices in `grads`, and (packed) the one gradient to zero first.
    pub(super) fn grads_at(&self, grads: &mut [Vec<f32>]) -> ([Mat; 3], Option<(u64, usize)>) {
        let bases: Vec<u64> = grads.iter_mut().map(|g| to(g)).collect();
        let packed = self.tensors.len() == 1;
        (
            self.mats(&bases),
            packed.then(|| (bases[0], grads[0].len())),
        )
    }

    /// The plan's P, O and gradients, run on the emulator.
    fn planned(
        &self,
        emu: &Emulator,
        d_o: &[f32],
        descending: bool,
    ) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
        let [bn, hn, t, s, _] = self.dims;
        let mut p = vec![f32::NAN; bn * hn * t * s];
        let (mut o, mut grads) = self.outputs();
        let mut x = self.at(&mut o, &mut p);
        let plan = attention(&x, self.scale, self.causal).unwrap();
        // SAFETY: the buffers hold what the views index.
        unsafe { emu.run_steps(&plan, descending) }.unwrap();
        x.o = Mat::of(&self.out, at(d_o));
        let mut scratch = vec![f32::NAN; attention_grad_scratch(&x)];
        let ([dq, dkt, dv], zero) = self.grads_at(&mut grads);
        let g = AttentionGradAt {
            dq,
            dkt,
            dv,
            zero,
            scratch: to(&mut scratch),
        };
        let plan = attention_grad(&x, &g, self.scale).unwrap();
        // SAFETY: as above.
        unsafe { emu.run_steps(&plan, descending) }.unwrap();
        (p, o, grads)
    }
}

/// Attention's plan (the products as cuBLAS defines them, on the views the CPU kernel
/// reads, and `attention.cu`'s row kernels) against float64, forward and backward:
/// GPT-2's packed causal layout (with a gap no part covers, zeroed in the gradient), and
/// three tensors with an additive padding mask `[B, 1, 1, S]`, queries fewer than keys,
/// K given as `[B, H, S, D]`, O left `[B, H, T, E]`. The same bits with each block's
/// threads in the other order.
#[test]
fn attention_plan_is_its_formula() {
    let emu = Emulator::compile(ATTENTION_SOURCE, "attention.cu");
    let cases = [
        ("packed causal", gpt2_case([2, 3, 6], 4)),
        ("three tensors", three_case([2, 3, 6, 9], 4)),
    ];
    for (name, case) in cases {
        let d_o = wave(case.out_len, 34);
        let (p, o, grads) = case.planned(&emu, &d_o, false);
        let other = case.planned(&emu, &d_o, true);
        let same = bits(&p) == bits(&other.0) && bits(&o) == bits(&other.1);
        assert!(same, "{name}: no race, the same bits in either order");
        let (want_p, want_o, want_grads, _) = case.reference(&d_o);
        close(&p, &want_p, 1e-5, &format!("{name}: P"));
        close(&o, &want_o, 1e-5, &format!("{name}: O"));
        for (k, (g, want)) in grads.iter().zip(&want_grads).enumerate() {
            close(g, want, 1e-4, &format!("{name}: gradient {k}"));
        }
    }
}

/// GPT-2's packed causal layout: `[B, T, 3 H D + 3]` (a gap of one value before each part),
/// Q, K, V parts read through their permutations, O `[B, T, H, D]`.
pub(super) fn gpt2_case([bn, hn, t]: [usize; 3], d: usize) -> AttentionCase {
    let w = 3 * hn * d + 3;
    let shape = [bn as i64, t as i64, w as i64];
    let part = |off: usize, perm| View::part(&shape, [hn, d], off, perm).unwrap();
    AttentionCase {
        dims: [bn, hn, t, t, d],
        causal: true,
        scale: 0.5,
        views: [
            (0, part(1, [0, 2, 1, 3])),
            (0, part(1 + hn * d, [0, 2, 3, 1])),
            (0, part(3 + 2 * hn * d, [0, 2, 1, 3])),
        ],
        out: View::made([bn, hn, t, d], [0, 2, 1, 3]).1,
        out_len: bn * t * hn * d,
        tensors: vec![wave(bn * t * w, 30)],
        mask: None,
    }
}

/// Three tensors with an additive padding mask `[B, 1, 1, S]` (BERT's: entry 1's last three
/// keys left out), `s` keys for `t` queries, K given as `[B, H, S, D]`, O `[B, H, T, E]`.
pub(super) fn three_case([bn, hn, t, s]: [usize; 4], d: usize) -> AttentionCase {
    let q = [bn as i64, hn as i64, t as i64, d as i64];
    let k = [bn as i64, hn as i64, s as i64, d as i64];
    AttentionCase {
        dims: [bn, hn, t, s, d],
        causal: false,
        scale: 0.3,
        views: [
            (0, View::of(&q, [0, 1, 2, 3]).unwrap()),
            (1, View::of(&k, [0, 1, 3, 2]).unwrap()),
            (2, View::of(&k, [0, 1, 2, 3]).unwrap()),
        ],
        out: View::made([bn, hn, t, d], [0, 1, 2, 3]).1,
        out_len: bn * hn * t * d,
        tensors: vec![
            wave(bn * hn * t * d, 31),
            wave(bn * hn * s * d, 32),
            wave(bn * hn * s * d, 33),
        ],
        mask: Some((
            (0..bn * s)
                .map(|k| {
                    if k >= s && k % s >= s - 3 {
                        -1e4
                    } else {
                        0.1 * (k % 5) as f32
                    }
                })
                .collect(),
            [s, 0, 0, 1],
        )),
    }
}
