//! Optimizers against independent `f64` references written from the papers / PyTorch docs,
//! hand-computed closed forms of single steps, checkpointed state, and LR schedules at
//! their landmarks. Validation and serde are tested beside the config types
//! (`src/optim/{config,schedule}.rs`).

use std::f64::consts::PI;

use pipetrain::optim::{build, LrDecay, LrSchedule, Optimizer, OptimizerConfig, ParamLayout};
use pipetrain::Error;

/// Three tensors of different sizes, so per-tensor code (LAMB) sees real boundaries.
fn layout() -> ParamLayout {
    ParamLayout::new([("w", vec![3, 4]), ("b", vec![4]), ("g", vec![5])])
}

/// Initial parameters, rounded to `f32` before either side sees them.
fn params0(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0.9 * i as f64).cos() as f32 * 0.5)
        .collect()
}

/// Gradients of `steps` steps, of mixed sign and size, with some exact zeros.
fn grads(n: usize, steps: usize) -> Vec<Vec<f32>> {
    (0..steps)
        .map(|s| {
            (0..n)
                .map(|i| match i % 7 {
                    3 => 0.0,
                    _ => ((1.3 * i as f64 + 0.7 * s as f64).sin() * (1.0 + i as f64 / 4.0)) as f32,
                })
                .collect()
        })
        .collect()
}

fn opt(cfg: &OptimizerConfig) -> Box<dyn Optimizer> {
    build(cfg, &layout()).unwrap()
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}: value {i}: got {g}, want {w}"
        );
    }
}

/// Runs `opt` and the reference `step_ref` side by side, comparing after every step.
fn compare(
    cfg: &OptimizerConfig,
    lr: f64,
    steps: usize,
    tol: f64,
    mut step_ref: impl FnMut(&mut [f64], &[f64], usize),
) {
    let n = layout().len();
    let mut p = params0(n);
    let mut want: Vec<f64> = p.iter().map(|&x| x.into()).collect();
    let mut o = opt(cfg);
    for (s, g) in grads(n, steps).iter().enumerate() {
        o.step(&mut p, g, lr).unwrap();
        let g64: Vec<f64> = g.iter().map(|&x| x.into()).collect();
        step_ref(&mut want, &g64, s + 1);
        assert_close(&p, &want, tol, &format!("{cfg:?} after step {}", s + 1));
    }
    assert_eq!(o.step_count(), steps as u64);
}

/// An optimizer config from its TOML text, so that the defaults come from serde as in a run.
fn cfg(toml: &str) -> OptimizerConfig {
    toml::from_str(toml).unwrap()
}

fn sgd(momentum: f64, dampening: f64, nesterov: bool, weight_decay: f64) -> OptimizerConfig {
    cfg(&format!(
        "kind = 'sgd'\nmomentum = {momentum:?}\ndampening = {dampening:?}\n\
         nesterov = {nesterov}\nweight_decay = {weight_decay:?}"
    ))
}

/// Adam, AdamW or LAMB with the defaults (betas 0.9 / 0.999; eps 1e-8, LAMB 1e-6).
fn adam_like(kind: &str, weight_decay: f64) -> OptimizerConfig {
    cfg(&format!("kind = '{kind}'\nweight_decay = {weight_decay:?}"))
}

fn adam(weight_decay: f64) -> OptimizerConfig {
    adam_like("adam", weight_decay)
}

fn adamw(weight_decay: f64) -> OptimizerConfig {
    adam_like("adamw", weight_decay)
}

fn lamb(weight_decay: f64) -> OptimizerConfig {
    adam_like("lamb", weight_decay)
}

#[test]
fn sgd_matches_reference() {
    for (m, damp, nesterov, wd) in [
        (0.0, 0.0, false, 0.0),
        (0.0, 0.0, false, 0.1),
        (0.9, 0.0, false, 0.0),
        (0.8, 0.5, false, 0.05),
        (0.9, 0.0, true, 0.1),
    ] {
        let mut buf: Vec<f64> = Vec::new();
        compare(&sgd(m, damp, nesterov, wd), 0.05, 6, 1e-6, |p, g, t| {
            let g: Vec<f64> = g.iter().zip(p.iter()).map(|(g, p)| g + wd * p).collect();
            // torch.optim.SGD: the buffer starts as the first gradient, undamped.
            buf = if t == 1 {
                g.clone()
            } else {
                buf.iter()
                    .zip(&g)
                    .map(|(b, g)| m * b + (1.0 - damp) * g)
                    .collect()
            };
            for i in 0..p.len() {
                let d = match (m == 0.0, nesterov) {
                    (true, _) => g[i],
                    (false, true) => g[i] + m * buf[i],
                    (false, false) => buf[i],
                };
                p[i] -= 0.05 * d;
            }
        });
    }
}

#[test]
fn sgd_momentum_closed_forms() {
    let l = ParamLayout::new([("x", vec![2])]);
    // Heavy ball, dampening 0.5: step 1 is plain SGD (buffer = g), step 2 uses
    // 0.75 g1 + 0.5 g2.
    // All values are exact in binary, so the results are too.
    let mut o = build(&sgd(0.75, 0.5, false, 0.0), &l).unwrap();
    let mut p = vec![1.0f32, -2.0];
    o.step(&mut p, &[0.5, 0.25], 0.5).unwrap();
    assert_eq!(p, [0.75, -2.125]);
    o.step(&mut p, &[1.0, -1.0], 0.5).unwrap();
    // buffer = 0.75 * [0.5, 0.25] + 0.5 * [1, -1] = [0.875, -0.3125]
    assert_eq!(o.state()[0], ("momentum_buffer", &[0.875f32, -0.3125][..]));
    assert_eq!(p, [0.75 - 0.4375, -2.125 + 0.15625]);
    // Nesterov, one step: d = g + m * g.
    let mut o = build(&sgd(0.5, 0.0, true, 0.0), &l).unwrap();
    let mut p = vec![1.0f32, 1.0];
    o.step(&mut p, &[1.0, -0.5], 0.25).unwrap();
    assert_eq!(p, [1.0 - 0.25 * 1.5, 1.0 + 0.25 * 0.75]);
    // L2 decay enters the gradient: g = 0 still moves p by -lr * wd * p.
    let mut o = build(&sgd(0.0, 0.0, false, 0.5), &l).unwrap();
    let mut p = vec![2.0f32, -4.0];
    o.step(&mut p, &[0.0, 0.0], 0.5).unwrap();
    assert_eq!(p, [1.5, -3.0]);
    assert!(o.state().is_empty(), "plain SGD keeps no state");
}

/// Adam / AdamW as the PyTorch docs and the peers' README write them, in `f64`.
fn adam_reference(wd: f64, decoupled: bool, lr: f64) -> impl FnMut(&mut [f64], &[f64], usize) {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
    let (mut m, mut v) = (Vec::new(), Vec::new());
    move |p, g, t| {
        m.resize(p.len(), 0.0);
        v.resize(p.len(), 0.0);
        for i in 0..p.len() {
            let g = if decoupled { g[i] } else { g[i] + wd * p[i] };
            if decoupled {
                p[i] *= 1.0 - lr * wd;
            }
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            let m_hat = m[i] / (1.0 - b1.powi(t as i32));
            let v_hat = v[i] / (1.0 - b2.powi(t as i32));
            p[i] -= lr * m_hat / (v_hat.sqrt() + eps);
        }
    }
}

#[test]
fn adam_and_adamw_match_reference_through_step_10() {
    for wd in [0.0, 0.1] {
        compare(&adam(wd), 0.01, 10, 2e-6, adam_reference(wd, false, 0.01));
    }
    for wd in [0.0, 0.01, 0.5] {
        compare(&adamw(wd), 0.01, 10, 2e-6, adam_reference(wd, true, 0.01));
    }
}

#[test]
fn adam_closed_forms() {
    let l = ParamLayout::new([("x", vec![4])]);
    let (lr, wd) = (0.01f64, 0.1f64);
    let p0 = [1.0f32, -2.0, 0.5, 3.0];
    let g = [0.3f32, -2.0, 0.0, 1e-3];
    // AdamW step 1: m_hat = g, v_hat = g^2, so p moves by lr * sign(g) after the decay
    // (to within lr * eps / |g| <= 1e-7 here); a zero gradient leaves only the decay.
    let mut o = build(&adamw(wd), &l).unwrap();
    let mut p = p0.to_vec();
    o.step(&mut p, &g, lr).unwrap();
    for i in 0..4 {
        let sign = if g[i] == 0.0 {
            0.0
        } else {
            f64::from(g[i]).signum()
        };
        let want = f64::from(p0[i]) * (1.0 - lr * wd) - lr * sign;
        assert!(
            (f64::from(p[i]) - want).abs() < 5e-7,
            "value {i}: {} vs {want}",
            p[i]
        );
    }
    // Adam step 1: the same with g + wd * p in place of g, and no separate decay.
    let mut o = build(&adam(wd), &l).unwrap();
    let mut p = p0.to_vec();
    o.step(&mut p, &g, lr).unwrap();
    for i in 0..4 {
        let want = f64::from(p0[i]) - lr * (f64::from(g[i]) + wd * f64::from(p0[i])).signum();
        assert!(
            (f64::from(p[i]) - want).abs() < 5e-7,
            "value {i}: {} vs {want}",
            p[i]
        );
    }
    // A constant gradient makes m_hat = g and v_hat = g^2 at every t: only correct bias
    // correction keeps each of 10 steps at exactly lr.
    let mut o = build(&adam(0.0), &l).unwrap();
    let mut p = p0.to_vec();
    for _ in 0..10 {
        o.step(&mut p, &[0.3, -2.0, 0.5, 4.0], lr).unwrap();
    }
    for (i, sign) in [1.0, -1.0, 1.0, 1.0].iter().enumerate() {
        let want = f64::from(p0[i]) - 10.0 * lr * sign;
        assert!(
            (f64::from(p[i]) - want).abs() < 5e-6,
            "value {i}: {} vs {want}",
            p[i]
        );
    }
}

/// LAMB as You et al. 2019 / ONNX Runtime write it, in `f64`, per tensor of `layout()`.
fn lamb_reference(wd: f64, lr: f64) -> impl FnMut(&mut [f64], &[f64], usize) {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-6);
    let (mut m, mut v) = (Vec::new(), Vec::new());
    move |p, g, t| {
        m.resize(p.len(), 0.0);
        v.resize(p.len(), 0.0);
        for r in layout().ranges() {
            let mut d = Vec::new();
            for i in r.clone() {
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                let m_hat = m[i] / (1.0 - b1.powi(t as i32));
                let v_hat = v[i] / (1.0 - b2.powi(t as i32));
                d.push(m_hat / (v_hat.sqrt() + eps) + wd * p[i]);
            }
            let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
            let (pn, dn) = (norm(&p[r.clone()]), norm(&d));
            let ratio = if pn == 0.0 || dn == 0.0 { 1.0 } else { pn / dn };
            for (i, d) in r.zip(d) {
                p[i] -= lr * ratio * d;
            }
        }
    }
}

#[test]
fn lamb_matches_reference() {
    for wd in [0.0, 0.01] {
        compare(&lamb(wd), 0.01, 6, 2e-6, lamb_reference(wd, 0.01));
    }
}

#[test]
fn lamb_trust_ratio_closed_forms() {
    // Tensor a: |g| all equal, so d = c * sign(g) with c = 1 / (1 + eps / |g|), ||d|| = 2c,
    // r = ||p|| / 2c = 5 / 2c, and p moves by lr * r * d = 0.25 * sign(g) exactly.
    // Tensor z: p = 0, so r = 1 and p becomes -lr * sign(g).
    // Tensor q: g = 0 and no decay, so d = 0, r = 1, and p stays (no 0 / 0).
    let l = ParamLayout::new([("a", vec![4]), ("z", vec![2]), ("q", vec![2])]);
    let mut o = build(&lamb(0.0), &l).unwrap();
    let p0 = vec![4.0f32, -2.0, 1.0, 2.0, 0.0, 0.0, 7.0, -7.0];
    let g = [0.5f32, -0.5, 0.5, 0.5, -2.0, 3.0, 0.0, 0.0];
    let lr = 0.1;
    let mut p = p0.clone();
    o.step(&mut p, &g, lr).unwrap();
    let want = [3.75, -1.75, 0.75, 1.75, 0.1, -0.1, 7.0, -7.0];
    assert_close(&p, &want, 1e-6, "lamb step 1");
    // With decay the direction gains wd * p before the norms: tensor q now moves by
    // exactly lr * wd * p * (||p|| / ||wd * p||) = lr * p.
    let mut o = build(&lamb(0.5), &l).unwrap();
    let mut p = p0;
    o.step(&mut p, &g, lr).unwrap();
    assert_close(&p[6..], &[6.3, -6.3], 1e-6, "lamb decay-only tensor");
}

#[test]
fn state_round_trips_and_bad_state_changes_nothing() {
    let n = layout().len();
    let gs = grads(n, 5);
    for cfg in [
        sgd(0.9, 0.1, false, 0.01),
        sgd(0.0, 0.0, false, 0.0),
        adam(0.1),
        adamw(0.01),
        lamb(0.01),
    ] {
        let (mut a, mut pa) = (opt(&cfg), params0(n));
        for g in &gs[..3] {
            a.step(&mut pa, g, 0.01).unwrap();
        }
        let saved: Vec<(&str, Vec<f32>)> =
            a.state().iter().map(|(k, v)| (*k, v.to_vec())).collect();
        let view: Vec<(&str, &[f32])> = saved.iter().map(|(k, v)| (*k, &v[..])).collect();
        let (mut b, mut pb) = (opt(&cfg), pa.clone());
        b.load_state(a.step_count(), &view).unwrap();
        for g in &gs[3..] {
            a.step(&mut pa, g, 0.01).unwrap();
            b.step(&mut pb, g, 0.01).unwrap();
        }
        assert_eq!(pa, pb, "{cfg:?}: resumed run differs");
        assert_eq!(b.step_count(), 5);

        let mut c = opt(&cfg);
        let short = [0.0f32; 3];
        let mut bad: Vec<Vec<(&str, &[f32])>> = vec![vec![("nonsense", &short[..])]];
        if let Some(first) = view.first() {
            bad.push(vec![(first.0, &short[..])]); // wrong length
            bad.push(view[1..].to_vec()); // one missing
            bad.push([view.clone(), vec![*first]].concat()); // one twice
        }
        for state in bad {
            let e = c.load_state(7, &state).unwrap_err();
            assert!(matches!(e, Error::BadTensor { .. }), "{cfg:?}: {e}");
            assert_eq!(
                c.step_count(),
                0,
                "{cfg:?}: a refused load must change nothing"
            );
            assert!(c.state().iter().all(|(_, v)| v.iter().all(|&x| x == 0.0)));
        }
    }
}

#[test]
fn step_refuses_buffers_that_do_not_match_the_layout() {
    let mut o = opt(&adamw(0.01));
    let mut p = vec![1.0f32; layout().len() - 1];
    let g = vec![1.0f32; layout().len()];
    let e = o.step(&mut p, &g, 0.1).unwrap_err();
    assert!(e.to_string().contains("parameters"), "{e}");
    let mut p = vec![1.0f32; layout().len()];
    let e = o.step(&mut p, &[1.0], 0.1).unwrap_err();
    assert!(e.to_string().contains("gradients"), "{e}");
    assert!(p.iter().all(|&x| x == 1.0) && o.step_count() == 0);
}

fn schedule(kind: LrDecay, warmup_ratio: f64) -> LrSchedule {
    LrSchedule {
        kind,
        lr: 0.1,
        warmup_ratio,
    }
}

#[test]
fn lr_schedules_at_their_landmarks() {
    let (poly, cos) = (
        LrDecay::Polynomial {
            power: 2.0,
            end_lr: 0.01,
        },
        LrDecay::Cosine { min_lr: 0.02 },
    );
    let kinds = [
        LrDecay::Constant,
        LrDecay::Linear,
        poly,
        LrDecay::Cosine { min_lr: 0.0 },
        cos,
    ];
    // 100 steps, 10 of warmup: step 55 is half-way through the decay, step 99 is the last.
    let last = 1.0 / 90.0;
    let want = |kind: &LrDecay, progress: f64| match *kind {
        LrDecay::Constant => 0.1,
        LrDecay::Linear => 0.1 * (1.0 - progress),
        LrDecay::Polynomial { .. } => 0.09 * (1.0 - progress).powi(2) + 0.01,
        LrDecay::Cosine { min_lr } => min_lr + (0.1 - min_lr) * 0.5 * (1.0 + (PI * progress).cos()),
    };
    let near = |a: f64, b: f64| (a - b).abs() < 1e-15;
    for kind in &kinds {
        let s = schedule(*kind, 0.1);
        let at = |step| s.lr_at(step, 100);
        assert_eq!(at(0), 0.0, "{kind:?}: warmup starts at 0");
        assert!(near(at(5), 0.05), "{kind:?}: half-way through warmup");
        assert!(near(at(10), 0.1), "{kind:?}: peak at the end of warmup");
        assert!(near(at(55), want(kind, 0.5)), "{kind:?}: mid-decay");
        assert!(near(at(99), want(kind, 1.0 - last)), "{kind:?}: last step");
        assert!(near(at(100), want(kind, 1.0)), "{kind:?}: at the end");
        assert_eq!(at(150), at(100), "{kind:?}: past the end it stays");
        let start = schedule(*kind, 0.0).lr_at(0, 100);
        assert!(near(start, 0.1), "{kind:?}: no warmup starts at the peak");
    }
    // Spot values by hand: mid-decay linear 0.05, cosine without floor 0.05, polynomial
    // 0.09 / 4 + 0.01; last step linear 0.1 / 90; cosine without floor ends at 0.
    assert!(near(schedule(LrDecay::Linear, 0.1).lr_at(55, 100), 0.05));
    assert!(near(schedule(kinds[3], 0.1).lr_at(55, 100), 0.05));
    assert!(near(schedule(poly, 0.1).lr_at(55, 100), 0.0325));
    assert!(near(
        schedule(LrDecay::Linear, 0.1).lr_at(99, 100),
        0.1 / 90.0
    ));
    assert!(near(schedule(kinds[3], 0.1).lr_at(100, 100), 0.0));
}

/// Parameter groups act per tensor: a tensor in a group is updated bitwise as by an
/// optimizer with the group's settings (its learning rate scaled), every other tensor as
/// by the ungrouped optimizer; for every kind, LAMB's per-tensor trust ratio included.
#[test]
fn param_groups_act_per_tensor() {
    use pipetrain::optim::{build_grouped, ParamGroup};
    let l = layout();
    let n = l.len();
    let b = l.offsets()[1]..l.offsets()[2];
    let run = |opt: &mut dyn Optimizer, lr: f64| {
        let mut p = params0(n);
        for g in grads(n, 6) {
            opt.step(&mut p, &g, lr).unwrap();
        }
        p
    };
    let cases = [
        (sgd(0.9, 0.0, true, 0.01), sgd(0.9, 0.0, true, 0.0), false),
        (
            adam(0.01),
            cfg("kind = \"adam\"\nbeta2 = 0.99\nweight_decay = 0.0"),
            true,
        ),
        (
            adamw(0.01),
            cfg("kind = \"adamw\"\nbeta2 = 0.99\nweight_decay = 0.0"),
            true,
        ),
        (
            lamb(0.01),
            cfg("kind = \"lamb\"\nbeta2 = 0.99\nweight_decay = 0.0"),
            true,
        ),
    ];
    for (base, as_group, moments) in cases {
        let group = ParamGroup {
            params: vec!["b".into()],
            weight_decay: Some(0.0),
            lr_scale: Some(0.5),
            beta1: None,
            beta2: moments.then_some(0.99),
            eps: None,
        };
        let grouped = run(build_grouped(&base, &[group], &l).unwrap().as_mut(), 1e-2);
        let plain = run(opt(&base).as_mut(), 1e-2);
        let alone = run(opt(&as_group).as_mut(), 0.5e-2);
        assert_eq!(
            grouped[b.clone()],
            alone[b.clone()],
            "{base:?}: the group's tensor"
        );
        assert_ne!(
            grouped[b.clone()],
            plain[b.clone()],
            "{base:?}: the group changes it"
        );
        for r in [0..b.start, b.end..n] {
            assert_eq!(grouped[r.clone()], plain[r], "{base:?}: the other tensors");
        }
    }
}
