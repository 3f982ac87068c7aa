use super::*;
use crate::compute::session::BoundInputs;
use crate::compute::{Buffer, Device, DeviceState, HostState, Runtime, SessionOptions};
use crate::graph::{make_node, ValueMeta};

/// `y = x * w`, its sum `loss`, and the gradient-like `g = x + x`.
fn model() -> crate::onnx::proto::ModelProto {
    let typed = [
        ("x", ValueMeta::f32(&[2, 3])),
        ("w", ValueMeta::f32(&[2, 3])),
    ];
    let nodes = vec![
        make_node("Mul", "mul", &["x", "w"], &["y"], vec![]),
        make_node("ReduceSum", "sum", &["y"], &["loss"], vec![]),
        make_node("Add", "add", &["x", "x"], &["g"], vec![]),
    ];
    crate::compute::test_model::standard_model("replayed", nodes, &typed, &["loss", "g", "y"])
}

fn w() -> Vec<f32> {
    (0..6).map(|i| i as f32 * 0.5 - 1.0).collect()
}

/// Runs of a session recorded as a graph, each on new data, give what runs of the same
/// graph without one give: the host input copied into its home every run (not the first
/// run's values replayed), the host outputs read from theirs, the gradient written in
/// place, whichever buffer it goes to; a second buffer records a second graph; a new
/// shape, and a run of another kind, are refused.
fn replays_as_it_runs(device: Device, mut state: Box<dyn DeviceState>) {
    let rt = Runtime::from_env().unwrap();
    let plain = SessionOptions {
        device,
        ..SessionOptions::default()
    };
    let graphed = SessionOptions {
        cuda_graph: true,
        ..plain
    };
    let mut reference = GraphSession::from_model(&rt, &model(), &plain, "plain").unwrap();
    let mut replayed = GraphSession::from_model(&rt, &model(), &graphed, "replayed").unwrap();
    let shape = [2usize, 3];
    let g = Target {
        output: 1,
        offset: 0,
        shape: &shape,
    };
    let grads = state.grads();
    let scratch = state.scratch().unwrap();
    for run in 0..5 {
        let x: Vec<f32> = (0..6)
            .map(|i| (i * 7 + run * 3) as f32 * 0.25 - 2.0)
            .collect();
        let xt = Tensor::f32(vec![2, 3], x.clone()).unwrap();
        let host = [("x", xt.view())];
        let params = [("w", state.params(), &shape[..])];
        let out = if run == 3 { scratch } else { grads };
        let want = reference.run_device(&host, &params, out, &[g]).unwrap();
        let mut want_g = vec![0f32; 6];
        read(&*state, out, &mut want_g);
        let got = replayed.run_device(&host, &params, out, &[g]).unwrap();
        let mut got_g = vec![0f32; 6];
        read(&*state, out, &mut got_g);
        assert_eq!(got, want, "run {run}: the host outputs");
        assert_eq!(got_g, want_g, "run {run}: the gradient");
        assert_eq!(got_g, x.iter().map(|v| v + v).collect::<Vec<_>>());
    }
    let recorded = replayed.replay.as_ref().unwrap();
    assert_eq!(
        recorded.graphs.len(),
        2,
        "one graph for each gradient buffer"
    );
    let wide = Tensor::f32(vec![3, 2], vec![0.0; 6]).unwrap();
    let params = [("w", state.params(), &shape[..])];
    let e = replayed
        .run_device(&[("x", wide.view())], &params, grads, &[g])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("runtime.cuda_graph") && e.contains("[3, 2]"),
        "{e}"
    );
    let inputs = BoundInputs {
        host: vec![],
        device: vec![],
        held: vec![],
    };
    let e = replayed
        .run_bound(&inputs, grads, &[], &|_| false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("runtime.cuda_graph"), "{e}");
}

/// `out`'s values (the gradient buffer or the scratch buffer) on the host.
fn read(state: &dyn DeviceState, out: DeviceSpan, into: &mut [f32]) {
    match out.addr == state.grads().addr {
        true => state.download(Buffer::Grads, into).unwrap(),
        false => {
            let t = over_value(out);
            into.copy_from_slice(&t);
        }
    }
}

/// The scratch buffer's first six values (its owner has no download for it).
fn over_value(out: DeviceSpan) -> Vec<f32> {
    let info = memory_info(out.device).unwrap();
    let v = over(&info, out.addr as *mut f32, &[6], "scratch").unwrap();
    let held = DeviceValue::new(v, "scratch", out.device).unwrap();
    held.to_host("scratch").unwrap().as_f32().unwrap().to_vec()
}

#[test]
fn a_replayed_session_reads_each_runs_inputs_and_writes_each_runs_outputs() {
    replays_as_it_runs(Device::Cpu, Box::new(HostState::new(&w(), &[])));
}

/// The same on a GPU (skipped without one), where ONNX Runtime records the run as a CUDA
/// graph and replays it.
#[cfg(feature = "cuda")]
#[test]
fn on_a_gpu_a_replayed_session_reads_each_runs_inputs_and_writes_each_runs_outputs() {
    if crate::compute::test_model::no_gpu() {
        return;
    }
    let state = crate::compute::cuda_state::CudaState::new(0, &w(), &[]).unwrap();
    replays_as_it_runs(Device::Cuda(0), Box::new(state));
}

/// A graph with a host-drawn random operator is refused for recording, naming the field,
/// the node and its operator; without one it is not.
#[test]
fn a_graph_that_draws_on_the_host_is_not_recorded() {
    let mut drawn = model();
    let g = drawn.graph.as_mut().unwrap();
    g.node
        .push(make_node("Dropout", "drop", &["y"], &["y_dropped"], vec![]));
    let e = check_replayable(&drawn, "stage 0").unwrap_err().to_string();
    assert!(
        e.contains("runtime.cuda_graph") && e.contains("`drop` (Dropout)"),
        "{e}"
    );
    assert!(check_replayable(&model(), "stage 0").is_ok());
}
