//! The device state's tests on a GPU (each skipped without one).

use super::*;
use pipetrain_actors::LocalCollective;

fn random(n: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// On a GPU (skipped without one): three replicas' gradients on one device, summed in
/// device memory (`compute/replicas.rs`), are bitwise the host all-reduce's sum
/// (replica order) in every replica.
#[test]
fn on_a_gpu_replicas_sum_their_gradients_as_the_host_all_reduce_does() {
    use pipetrain_actors::Collective;
    if crate::compute::test_model::no_gpu() {
        return;
    }
    let n = 1_000_003;
    let grads: Vec<Vec<f32>> = (0..3u64)
        .map(|r| {
            random(n, 50 + r)
                .iter()
                .map(|x| x * 10f32.powi(r as i32 - 1))
                .collect()
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let host = LocalCollective::spawn(1, 3, &mut tokio::task::JoinSet::new());
    let want = rt.block_on(async {
        let (a, b, c) = tokio::join!(
            host.all_reduce_sum(0, 0, grads[0].clone()),
            host.all_reduce_sum(0, 1, grads[1].clone()),
            host.all_reduce_sum(0, 2, grads[2].clone()),
        );
        [a.unwrap(), b.unwrap(), c.unwrap()]
    });
    let mut states: Vec<CudaState> = grads
        .iter()
        .map(|g| {
            let mut s = CudaState::new(0, &vec![0.0; n], &[]).unwrap();
            s.upload(Buffer::Grads, g).unwrap();
            s
        })
        .collect();
    let group = crate::compute::ReplicaGroup::new(3);
    let (l0, l1, l2) = (group.link(0), group.link(1), group.link(2));
    let [s0, s1, s2] = &mut states[..] else {
        unreachable!()
    };
    let done = rt
        .block_on(async { tokio::join!(l0.all_reduce(s0), l1.all_reduce(s1), l2.all_reduce(s2)) });
    [done.0, done.1, done.2]
        .into_iter()
        .for_each(|d| d.unwrap());
    for (r, s) in states.iter().enumerate() {
        let mut back = vec![0f32; n];
        s.download(Buffer::Grads, &mut back).unwrap();
        let differ = back
            .iter()
            .zip(&want[r])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "replica {r}: {differ} of {n} sums differ from the host's"
        );
    }
}

/// On a GPU (skipped without one): two steps of SGD with momentum and of AdamW, in
/// two stretches of different settings, give bitwise the values of the same program
/// on the CPU (`ElementwiseStep::apply_on_host`, itself bitwise the optimizers'
/// loops); the gradients' sum of squares equals float64's to 1e-12 and repeats bit
/// for bit; an injected infinity makes it infinite.
#[test]
fn on_a_gpu_the_update_is_bitwise_the_cpus_and_the_norm_repeats() {
    if crate::compute::test_model::no_gpu() {
        return;
    }
    let n = 3_000_017;
    let layout = crate::optim::ParamLayout::new([("w", vec![n - 17]), ("b", vec![17])]);
    let group = |adam: bool| crate::optim::ParamGroup {
        params: vec!["b".into()],
        weight_decay: Some(0.0),
        lr_scale: Some(0.5),
        beta1: adam.then_some(0.8),
        beta2: None,
        eps: None,
    };
    for (text, adam) in [
        ("kind = \"sgd\"\nmomentum = 0.9\nweight_decay = 0.01", false),
        ("kind = \"adamw\"\nweight_decay = 0.1", true),
    ] {
        let cfg: crate::optim::OptimizerConfig = toml::from_str(text).unwrap();
        let mut opt = crate::optim::build_grouped(&cfg, &[group(adam)], &layout).unwrap();
        let mut p = random(n, 1);
        let mut host_state: Vec<Vec<f32>> = opt.state().iter().map(|(_, b)| b.to_vec()).collect();
        let views: Vec<&[f32]> = host_state.iter().map(Vec::as_slice).collect();
        let mut dev = CudaState::new(0, &p, &views).unwrap();
        for step in 0..2u64 {
            let g = random(n, 10 + step);
            dev.upload(Buffer::Grads, &g).unwrap();
            let program = opt.elementwise_step(1e-2).unwrap();
            program.apply_on_host(&mut p, &g, &mut host_state, 0.5);
            dev.apply(&program, 0.5).unwrap();
        }
        let mut back = vec![0f32; n];
        dev.download(Buffer::Params, &mut back).unwrap();
        let same = back
            .iter()
            .zip(&p)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        assert_eq!(same, n, "{text}: {} of {n} parameters differ", n - same);
        for (k, want) in host_state.iter().enumerate() {
            dev.download(Buffer::State(k), &mut back).unwrap();
            assert!(back == *want, "{text}: state buffer {k} differs");
        }
        let g = random(n, 99);
        dev.upload(Buffer::Grads, &g).unwrap();
        let exact: f64 = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let (a, b) = (dev.grad_sum_sq().unwrap(), dev.grad_sum_sq().unwrap());
        assert_eq!(a.to_bits(), b.to_bits(), "the sum repeats");
        assert!(((a - exact) / exact).abs() < 1e-9, "{a} against {exact}");
        dev.set_grad(5, f32::INFINITY).unwrap();
        assert!(!dev.grad_sum_sq().unwrap().is_finite());
    }
}

/// On a GPU with NCCL (skipped without one): the step's NCCL all-reduce over a one-rank
/// communicator (`debug.nccl_one_rank`) leaves the gradients bitwise as they were.
#[test]
fn on_a_gpu_a_one_rank_nccl_sum_is_the_gradients() {
    if crate::compute::test_model::no_gpu() {
        return;
    }
    let n = 300_007;
    let g = random(n, 77);
    let mut state = CudaState::new(0, &vec![0.0; n], &[]).unwrap();
    state.upload(Buffer::Grads, &g).unwrap();
    let id = crate::compute::ReplicaLink::nccl_id().unwrap();
    let cuda0 = [(crate::compute::Device::Cuda(0), 0)];
    let link = crate::compute::ReplicaLink::nccl(&cuda0, 1, id)
        .unwrap()
        .remove(0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(link.all_reduce(&mut state)).unwrap();
    let mut back = vec![0f32; n];
    state.download(Buffer::Grads, &mut back).unwrap();
    assert!(back == g, "the one-rank sum changed the gradients");
}
