//! Each CUDA kernel, run on the CPU through its launch plan ([`super::emu`]), against its
//! formula: bitwise where the CPU's code computes in the kernel's order (the update, the
//! embedding gradient, the dropout masks, the tanh GELU), else against float64.

use super::emu::Emulator;
use super::*;

/// `n` values spread over about [-3, 3], different for each `k`.
fn wave(n: usize, k: u32) -> Vec<f32> {
    (0..n)
        .map(|i| 3.0 * ((i as f32 * 0.731 + k as f32 * 1.37).sin()))
        .collect()
}

/// Where a kernel reads `v`.
fn at<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}

/// Where a kernel writes `v`.
fn to<T>(v: &mut [T]) -> u64 {
    v.as_mut_ptr() as u64
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / w.abs().max(1.0);
        assert!(err <= tol, "{what}[{i}]: {g} against {w}");
    }
}

fn fused() -> Emulator {
    Emulator::compile(FUSED_SOURCE, "fused.cu")
}

/// `TanhGelu` and `TanhGeluGrad`: bitwise `graph::tanh_gelu` and its slope (the same
/// order of operations, no FMA, the same `tanhf`), over more values than one grid-strided
/// pass of its blocks covers would need.
#[test]
fn tanh_gelu_kernels_are_their_formulas_bitwise() {
    let emu = fused();
    let (n, k) = (70_001, (0.797_884_6, 0.044_715));
    let (x, dy) = (wave(n, 1), wave(n, 2));
    let (mut y, mut dx) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    let plan = [
        tanh_gelu(at(&x), to(&mut y), n, k),
        tanh_gelu_grad(at(&dy), at(&x), to(&mut dx), n, k),
    ];
    // SAFETY: every buffer holds n values.
    unsafe { emu.run(&plan) }.unwrap();
    for i in 0..n {
        let want = crate::graph::tanh_gelu(x[i], k.0, k.1);
        assert_eq!(y[i].to_bits(), want.to_bits(), "y[{i}]");
        let want = dy[i] * crate::graph::tanh_gelu_slope(x[i], k.0, k.1);
        assert_eq!(dx[i].to_bits(), want.to_bits(), "dx[{i}]");
    }
}

/// `SoftmaxGrad` over rows longer than a block and a row shorter: `y (dy - sum(dy y))`.
#[test]
fn softmax_grad_is_its_formula() {
    let emu = fused();
    for m in [1000, 37] {
        let rows = 5;
        let n = rows * m;
        let (dy, y) = (wave(n, 3), wave(n, 4));
        let mut dx = vec![f32::NAN; n];
        // SAFETY: every buffer holds n values.
        unsafe { emu.run(&[softmax_grad(at(&dy), at(&y), to(&mut dx), n, m)]) }.unwrap();
        let mut want = vec![0f64; n];
        for r in 0..rows {
            let row = r * m..(r + 1) * m;
            let s: f64 = row.clone().map(|j| dy[j] as f64 * y[j] as f64).sum();
            row.for_each(|j| want[j] = y[j] as f64 * (dy[j] as f64 - s));
        }
        close(&dx, &want, 1e-4, "dx");
    }
}

/// `LayerNormGrad` (never run on a GPU yet): `dx`, `dscale` and `dbias` against float64,
/// on rows longer than a block, more rows than chunks and a row count the chunks do not
/// divide; and the same bits twice.
#[test]
fn layer_norm_grad_is_its_formula() {
    let emu = fused();
    let (rows, cols) = (131, 300);
    let n = rows * cols;
    let (dy, x, scale) = (wave(n, 5), wave(n, 6), wave(cols, 7));
    let mean: Vec<f32> = (0..rows).map(|r| 0.1 * (r as f32).sin()).collect();
    let inv: Vec<f32> = (0..rows).map(|r| 0.5 + 0.01 * r as f32).collect();
    let run = || {
        let (mut dx, mut ds, mut db) = (
            vec![f32::NAN; n],
            vec![f32::NAN; cols],
            vec![f32::NAN; cols],
        );
        let mut scratch = vec![f32::NAN; layer_norm_grad_scratch(rows, cols)];
        let b = LayerNormGradAt {
            dy: at(&dy),
            x: at(&x),
            scale: at(&scale),
            mean: at(&mean),
            inv: at(&inv),
            dx: to(&mut dx),
            dscale: to(&mut ds),
            dbias: to(&mut db),
            scratch: to(&mut scratch),
        };
        // SAFETY: the buffers hold what `layer_norm_grad` indexes.
        unsafe { emu.run(&layer_norm_grad(b, rows, cols)) }.unwrap();
        (dx, ds, db)
    };
    let (dx, ds, db) = run();
    let (mut want_dx, mut want_ds, mut want_db) =
        (vec![0f64; n], vec![0f64; cols], vec![0f64; cols]);
    for r in 0..rows {
        let xh = |j: usize| (x[r * cols + j] as f64 - mean[r] as f64) * inv[r] as f64;
        let g = |j: usize| dy[r * cols + j] as f64 * scale[j] as f64;
        let m1 = (0..cols).map(g).sum::<f64>() / cols as f64;
        let m2 = (0..cols).map(|j| g(j) * xh(j)).sum::<f64>() / cols as f64;
        for j in 0..cols {
            want_dx[r * cols + j] = (g(j) - m1 - xh(j) * m2) * inv[r] as f64;
            want_ds[j] += dy[r * cols + j] as f64 * xh(j);
            want_db[j] += dy[r * cols + j] as f64;
        }
    }
    close(&dx, &want_dx, 1e-5, "dx");
    close(&ds, &want_ds, 1e-5, "dscale");
    close(&db, &want_db, 1e-5, "dbias");
    let again = run();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&again.0), bits(&dx), "dx repeats");
    assert_eq!(bits(&again.1), bits(&ds), "dscale repeats");
}

/// `KeyedDropout` (never run on a GPU yet): the CPU kernel's mask and values, bit for bit,
/// with and without the mask output.
#[test]
fn keyed_dropout_draws_the_cpu_masks() {
    let emu = fused();
    let n = 100_003;
    let x = wave(n, 8);
    let (ratio, key, salt) = ([0.3f32], [5i64, 17, 1, 2], 12345i64);
    let (mut y, mut mask, mut y2) = (vec![f32::NAN; n], vec![7u8; n], vec![f32::NAN; n]);
    let b = KeyedDropoutAt {
        x: at(&x),
        ratio: at(&ratio),
        key: at(&key),
        y: to(&mut y),
        mask: to(&mut mask),
    };
    let b2 = KeyedDropoutAt {
        y: to(&mut y2),
        mask: 0,
        ..b
    };
    let plan = [keyed_dropout(b, n, salt), keyed_dropout(b2, n, salt)];
    // SAFETY: x, y, y2 and the mask hold n values, the ratio one, the key four.
    unsafe { emu.run(&plan) }.unwrap();
    let draw = crate::compute::fused::KeyedDraw::new(
        crate::compute::fused::keyed_dropout_base(&key, salt as u64),
        ratio[0],
    );
    let scale = 1.0 / (1.0 - ratio[0]);
    for i in 0..n {
        let keep = draw.keeps(i);
        assert_eq!(mask[i], keep as u8, "mask[{i}]");
        let want = if keep { x[i] * scale } else { 0.0 };
        assert_eq!(y[i].to_bits(), want.to_bits(), "y[{i}]");
        assert_eq!(y2[i].to_bits(), want.to_bits(), "y without a mask, [{i}]");
    }
}

/// `RowsAdd`: bitwise `graph::rows_add_reference` (each row the sum of its updates in
/// position order from +0), with indices from the end, out of range, repeated across
/// the chain's tiles, and rows no index names at 0.
#[test]
fn rows_add_sums_in_position_order_bitwise() {
    let emu = Emulator::compile(ROWS_ADD_SOURCE, "rows_add.cu");
    let (n, rows, row_len) = (600usize, 50i64, 300usize);
    let indices: Vec<i64> = (0..n as i64)
        .map(|i| (i * 7) % 45 - 3 + (i == 5) as i64 * 90)
        .collect();
    let updates = wave(n * row_len, 9);
    let mut table = vec![f32::NAN; rows as usize * row_len];
    let mut scratch = vec![0i32; rows_add_scratch(n)];
    let b = RowsAddAt {
        indices: at(&indices),
        updates: at(&updates),
        table: to(&mut table),
        scratch: to(&mut scratch),
    };
    // SAFETY: the buffers hold what `rows_add` indexes.
    unsafe { emu.run(&rows_add(b, n, rows, row_len)) }.unwrap();
    let want = crate::graph::rows_add_reference(&indices, &updates, rows as usize);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&table), bits(&want));
}

/// The update kernels: bitwise the optimizers' host loop for each rule over two
/// segments with their own constants, and `add_into`.
#[test]
fn update_kernels_are_the_host_loop_bitwise() {
    let emu = Emulator::compile(UPDATE_SOURCE, "update.cu");
    let n = 5000;
    let k1 = [0.01, 0.1, 0.9, 0.05, 0.99, 1e-8, 0.7, 0.003];
    let k2 = [0.02, 0.0, 0.8, 0.1, 0.999, 1e-6, 0.9, 0.001];
    for rule in [Rule::Sgd, Rule::SgdMomentum, Rule::Adam] {
        let step = ElementwiseStep {
            rule,
            segments: vec![(0..3000, k1), (3000..n, k2)],
        };
        let (mut p, g) = (wave(n, 10), wave(n, 11));
        let states = update_kernel(rule).1;
        let mut state: Vec<Vec<f32>> = (0..states).map(|s| wave(n, 12 + s as u32)).collect();
        let (mut want_p, mut want_state) = (p.clone(), state.clone());
        step.apply_on_host(&mut want_p, &g, &mut want_state, 0.5);
        let bufs: Vec<u64> = state.iter_mut().map(|s| to(s)).collect();
        let plan = update(&step, 0.5, (to(&mut p), at(&g)), &bufs).unwrap();
        // SAFETY: every buffer holds n values.
        unsafe { emu.run(&plan) }.unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p), bits(&want_p), "{rule:?} parameters");
        for (s, w) in state.iter().zip(&want_state) {
            assert_eq!(bits(s), bits(w), "{rule:?} state");
        }
        let wrong = update(
            &step,
            0.5,
            (at(&p), at(&g)),
            &bufs[..states.saturating_sub(1)],
        );
        assert_eq!(wrong.is_err(), states > 0, "{rule:?} with a buffer short");
    }
    let (mut acc, x) = (wave(n, 20), wave(n, 21));
    let want: Vec<f32> = acc.iter().zip(&x).map(|(a, b)| a + b).collect();
    // SAFETY: both hold n values.
    unsafe { emu.run(&[add_into(to(&mut acc), at(&x), n)]) }.unwrap();
    assert_eq!(acc, want);
}

/// The gradients' sum of squares: within float64 rounding of a float64 sum, and the same
/// bits again.
#[test]
fn grad_sum_of_squares_is_float64s_and_repeats() {
    let emu = Emulator::compile(UPDATE_SOURCE, "update.cu");
    let g = wave(300_007, 13);
    let want: f64 = g.iter().map(|&x| x as f64 * x as f64).sum();
    let run = || {
        let (mut partial, mut total) = (vec![f64::NAN; SUM_BLOCKS as usize], [f64::NAN]);
        let plan = grad_sum_sq(at(&g), g.len(), to(&mut partial), to(&mut total));
        // SAFETY: the partials hold SUM_BLOCKS values, the total one.
        unsafe { emu.run(&plan) }.unwrap();
        total[0]
    };
    let got = run();
    assert!((got - want).abs() <= 1e-12 * want, "{got} against {want}");
    assert_eq!(run().to_bits(), got.to_bits());
}

/// The checks can fail: arguments of the wrong type or count are refused before a
/// launch, and a barrier some live threads of a block skip is reported.
#[test]
fn the_emulator_refuses_wrong_arguments_and_divergent_barriers() {
    let emu = fused();
    let mut x = vec![1f32; 10];
    let mut bad = tanh_gelu(at(&x), to(&mut x), 10, (1.0, 1.0));
    bad.args[3] = Arg::I32(1);
    // SAFETY: refused before it runs.
    let err = unsafe { emu.run(&[bad.clone()]) }.unwrap_err();
    assert!(err.contains("argument 3"), "{err}");
    bad.args.pop();
    let err = unsafe { emu.run(&[bad]) }.unwrap_err();
    assert!(err.contains("4 arguments for 5"), "{err}");
    let source = "extern \"C\" __global__ void split(float* x) {\n\
                  if (threadIdx.x < 5) __syncthreads();\n x[threadIdx.x] = 1.0f;\n}\n";
    let emu = Emulator::compile(source, "split.cu");
    let mut x = vec![0f32; THREADS as usize];
    let plan = Launch::new("split", (1, 1), vec![Arg::Ptr(to(&mut x))]);
    // SAFETY: x holds a block's values.
    let err = unsafe { emu.run(&[plan]) }.unwrap_err();
    assert!(err.contains("barrier"), "{err}");
}

/// One attention case: the tensors' views (from the CPU kernel's layouts), values and a
/// float64 reference of the forward and backward.
struct AttentionCase {
    dims: [usize; 5], // B, H, T, S, D (= E)
    causal: bool,
    scale: f32,
    /// q, kt, v: (tensor index, view); one tensor when packed.
    views: [(usize, crate::compute::fused::View); 3],
    out: crate::compute::fused::View,
    out_len: usize,
    tensors: Vec<Vec<f32>>,
}

impl AttentionCase {
    fn value(&self, i: usize, [b, h, r, c]: [usize; 4]) -> f64 {
        let (t, v) = self.views[i];
        let at =
            v.offset + b * v.strides[0] + h * v.strides[1] + r * v.strides[2] + c * v.strides[3];
        self.tensors[t][at] as f64
    }

    fn index(v: &crate::compute::fused::View, [b, h, r, c]: [usize; 4]) -> usize {
        v.offset + b * v.strides[0] + h * v.strides[1] + r * v.strides[2] + c * v.strides[3]
    }

    /// P, O, and the gradients of the tensors for `d_o` (in O's layout), in float64.
    fn reference(&self, d_o: &[f32]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
        let [bn, hn, t, s, d] = self.dims;
        let mut p = vec![0f64; bn * hn * t * s];
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
                        })
                        .collect();
                    let top = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let total: f64 = sc.iter().map(|x| (x - top).exp()).sum();
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
        (p, o, grads)
    }

    /// The plan's P, O and gradients, run on the emulator.
    fn planned(&self, emu: &Emulator, d_o: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
        let [bn, hn, t, s, _] = self.dims;
        let mut p = vec![f32::NAN; bn * hn * t * s];
        let mut o = vec![f32::NAN; self.out_len];
        let mut grads: Vec<Vec<f32>> = self
            .tensors
            .iter()
            .map(|x| vec![f32::NAN; x.len()])
            .collect();
        let mat = |i: usize, base: u64| Mat::of(&self.views[i].1, base);
        let bases: Vec<u64> = self.tensors.iter().map(|x| at(x)).collect();
        let mut x = AttentionAt {
            batch: bn,
            heads: hn,
            q: mat(0, bases[self.views[0].0]),
            kt: mat(1, bases[self.views[1].0]),
            v: mat(2, bases[self.views[2].0]),
            o: Mat::of(&self.out, to(&mut o)),
            p: to(&mut p),
        };
        let plan = attention(&x, self.scale, self.causal).unwrap();
        // SAFETY: the buffers hold what the views index.
        unsafe { emu.run_steps(&plan) }.unwrap();
        x.o = Mat::of(&self.out, at(d_o));
        let mut scratch = vec![f32::NAN; attention_grad_scratch(&x)];
        let gbase: Vec<u64> = grads.iter_mut().map(|g| to(g)).collect();
        let packed = self.tensors.len() == 1;
        let g = AttentionGradAt {
            dq: mat(0, gbase[self.views[0].0]),
            dkt: mat(1, gbase[self.views[1].0]),
            dv: mat(2, gbase[self.views[2].0]),
            zero: packed.then(|| (gbase[0], grads[0].len())),
            scratch: to(&mut scratch),
        };
        let plan = attention_grad(&x, &g, self.scale).unwrap();
        // SAFETY: as above.
        unsafe { emu.run_steps(&plan) }.unwrap();
        (p, o, grads)
    }
}

/// Attention's plan (the products as cuBLAS defines them, on the views the CPU kernel
/// reads, and `attention.cu`'s row kernels) against float64, forward and backward:
/// GPT-2's packed causal layout (with a gap no part covers, zeroed in the gradient), and
/// three tensors, queries fewer than keys, K given as `[B, H, S, D]`, O left
/// `[B, H, T, E]`.
#[test]
fn attention_plan_is_its_formula() {
    use crate::compute::fused::View;
    let emu = Emulator::compile(ATTENTION_SOURCE, "attention.cu");
    let (bn, hn, t, d) = (2, 3, 6, 4);
    let w = 3 * hn * d + 3;
    let shape = [bn as i64, t as i64, w as i64];
    let part = |off: usize, perm| View::part(&shape, [hn, d], off, perm).unwrap();
    let gpt2 = AttentionCase {
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
    };
    let s = 9;
    let q = [bn as i64, hn as i64, t as i64, d as i64];
    let k = [bn as i64, hn as i64, s as i64, d as i64];
    let three = AttentionCase {
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
    };
    for (name, case) in [("packed causal", gpt2), ("three tensors", three)] {
        let d_o = wave(case.out_len, 34);
        let (p, o, grads) = case.planned(&emu, &d_o);
        let (want_p, want_o, want_grads) = case.reference(&d_o);
        close(&p, &want_p, 1e-5, &format!("{name}: P"));
        close(&o, &want_o, 1e-5, &format!("{name}: O"));
        for (k, (g, want)) in grads.iter().zip(&want_grads).enumerate() {
            close(g, want, 1e-4, &format!("{name}: gradient {k}"));
        }
    }
}
