//! Each CUDA kernel, run on the CPU through its launch plan ([`super::emu`]), against its
//! formula: bitwise where the CPU's code computes in the kernel's order (the update, the
//! embedding gradient, the dropout masks, the tanh GELU), else against float64.

use super::emu::Emulator;
use super::*;

/// `n` values spread over about [-3, 3], different for each `k`.
pub(super) fn wave(n: usize, k: u32) -> Vec<f32> {
    (0..n)
        .map(|i| 3.0 * ((i as f32 * 0.731 + k as f32 * 1.37).sin()))
        .collect()
}

/// Where a kernel reads `v`.
pub(super) fn at<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}

/// Where a kernel writes `v`.
pub(super) fn to<T>(v: &mut [T]) -> u64 {
    v.as_mut_ptr() as u64
}

/// The bits of `v`'s values.
pub(super) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub(super) fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
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
        let (mut dx, mut other) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        // SAFETY: every buffer holds n values.
        unsafe {
            emu.run(&[softmax_grad(at(&dy), at(&y), to(&mut dx), n, m)])
                .unwrap();
            emu.run_descending(&[softmax_grad(at(&dy), at(&y), to(&mut other), n, m)])
                .unwrap();
        }
        assert_eq!(
            bits(&dx),
            bits(&other),
            "no race: the same bits in either order"
        );
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
/// divide; and the same bits with each block's threads in the other order (no race).
#[test]
fn layer_norm_grad_is_its_formula() {
    let emu = fused();
    let (rows, cols) = (131, 300);
    let n = rows * cols;
    let (dy, x, scale) = (wave(n, 5), wave(n, 6), wave(cols, 7));
    let mean: Vec<f32> = (0..rows).map(|r| 0.1 * (r as f32).sin()).collect();
    let inv: Vec<f32> = (0..rows).map(|r| 0.5 + 0.01 * r as f32).collect();
    let run = |descending: bool| {
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
        let plan = layer_norm_grad(b, rows, cols);
        // SAFETY: the buffers hold what `layer_norm_grad` indexes.
        match descending {
            false => unsafe { emu.run(&plan) },
            true => unsafe { emu.run_descending(&plan) },
        }
        .unwrap();
        (dx, ds, db)
    };
    let (dx, ds, db) = run(false);
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
    let other = run(true);
    assert_eq!(
        bits(&other.0),
        bits(&dx),
        "dx: no race, the same bits in either order"
    );
    assert_eq!(
        bits(&other.1),
        bits(&ds),
        "dscale: the same bits in either order"
    );
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
    assert_eq!(bits(&table), bits(&want));
    table.fill(f32::NAN);
    // SAFETY: as above.
    unsafe { emu.run_descending(&rows_add(b, n, rows, row_len)) }.unwrap();
    assert_eq!(
        bits(&table),
        bits(&want),
        "no race: the same bits in either order"
    );
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
/// bits with each block's threads in the other order (no race).
#[test]
fn grad_sum_of_squares_is_float64s_in_either_order() {
    let emu = Emulator::compile(UPDATE_SOURCE, "update.cu");
    let g = wave(300_007, 13);
    let want: f64 = g.iter().map(|&x| x as f64 * x as f64).sum();
    let run = |descending: bool| {
        let (mut partial, mut total) = (vec![f64::NAN; SUM_BLOCKS as usize], [f64::NAN]);
        let plan = grad_sum_sq(at(&g), g.len(), to(&mut partial), to(&mut total));
        // SAFETY: the partials hold SUM_BLOCKS values, the total one.
        match descending {
            false => unsafe { emu.run(&plan) },
            true => unsafe { emu.run_descending(&plan) },
        }
        .unwrap();
        total[0]
    };
    let got = run(false);
    assert!((got - want).abs() <= 1e-12 * want, "{got} against {want}");
    assert_eq!(
        run(true).to_bits(),
        got.to_bits(),
        "the same bits in either order"
    );
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

/// A race shows: a block's tree sum without its barrier inside the loop gives other
/// bits with the threads in the other order (and the sum is wrong); with the barrier,
/// the same bits and the right sum.
#[test]
fn a_race_gives_other_results_in_the_other_order() {
    let source = |barrier: &str| {
        format!(
            "extern \"C\" __global__ void tree(const float* x, float* out) {{\n\
             __shared__ float part[256];\n part[threadIdx.x] = x[threadIdx.x];\n\
             __syncthreads();\n\
             for (int w = 128; w > 0; w >>= 1) {{\n\
             if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];\n {barrier}\n}}\n\
             if (threadIdx.x == 0) out[0] = part[0];\n}}\n"
        )
    };
    let x: Vec<f32> = (0..THREADS).map(|i| i as f32).collect();
    let want = x.iter().sum::<f32>();
    for (barrier, racy) in [("", true), ("__syncthreads();", false)] {
        let emu = Emulator::compile(&source(barrier), "tree.cu");
        let (mut a, mut b) = ([f32::NAN], [f32::NAN]);
        let plan = |out: u64| {
            [Launch::new(
                "tree",
                (1, 1),
                vec![Arg::Ptr(at(&x)), Arg::Ptr(out)],
            )]
        };
        // SAFETY: x holds a block's values, the output one.
        unsafe {
            emu.run(&plan(to(&mut a))).unwrap();
            emu.run_descending(&plan(to(&mut b))).unwrap();
        }
        assert_eq!(a[0] != b[0], racy, "{barrier:?}: {} and {}", a[0], b[0]);
        assert_eq!(a[0] == want && b[0] == want, !racy, "{barrier:?}: the sum");
    }
}
