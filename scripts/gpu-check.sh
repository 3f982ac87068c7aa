#!/usr/bin/env bash
# The GPU checks, in one command, for a machine with an NVIDIA GPU:
#   bash scripts/gpu-check.sh [--bin DIR] [--peers DIR] [--out DIR] [--quick]
#                             [--checks kernels,curves,pipeline,replicas,resume,precision,gpt2]
# - builds pipetrain with `--features cuda` (or takes the binary from --bin DIR, for a
#   machine without cargo);
# - `pipetrain doctor`: the library, its CUDA provider, the devices, a one-rank NCCL
#   all-reduce; without a GPU it says so and stops (exit 0);
# - kernels: the library's device tests (`compute::cuda_state`, `compute::cuda_ops`: the
#   NVRTC-compiled update bitwise the CPU's, the gradient norm repeatable, the embedding
#   gradient bitwise its formula, `compute::cuda_dropout`: the keyed dropout the CPU's
#   masks, `compute::cuda_attention`: the attention operators the CPU's,
#   `compute::session::bound`: a value left on the device by one session read by the
#   next, and copied back to the host intact, `compute::session::replay`: a session
#   recorded as a CUDA graph replayed on new inputs each run; then attention's
#   two GPU forms timed side by side, KERNELS_ATTENTION_TIMING=0: not), from the lib
#   test executable in --bin;
# - the peers' MLP and tiny GPT (SGD, AdamW) trained on the GPU and on the CPU, the loss
#   curves judged against PyTorch float64 (TF32 off; --peers names peers/data);
# - a 2-stage pipeline on one GPU with its Chrome trace (how long both stages computed
#   at once; and a 4-stage one, PIPELINE_PP4=0: not), its messages and stash left in device memory (`compute/session/bound.rs`):
#   its host traffic (the data in, losses and norms out) and its losses bitwise those of
#   the run with the state on the host;
# - two data-parallel replicas on one GPU summing their gradients in device memory
#   (`compute/replicas.rs`) against the same run reducing on the host: bitwise the same
#   losses, and each step's host traffic; and the step's NCCL all-reduce over a one-rank
#   communicator (`debug.nccl_one_rank`) against the plain run: bitwise the same losses;
# - checkpoint and resume on the GPU: 20 steps straight against 10 + 10 resumed, bitwise;
# - mixed precision: float16 and bfloat16 curves against float32 (PRECISION_TOL, default
#   0.05 in the loss), and an injected float16 overflow skipping its step, scale halved;
# - unless --quick, GPT-2 small (12 layers, d 768, seq 1024; GPT2_* variables change it)
#   tokens/s, pipetrain and, where PyTorch and transformers are installed, PyTorch eager
#   on the same model; also with `runtime.deterministic = false` (GPT2_UNORDERED=0: not)
#   and ONNX Runtime's profile of four steps (GPT2_PROFILE=0: not); GPT2_HALF=bf16|f16
#   adds a mixed-precision run against PyTorch eager under torch.autocast; GPT2_HOST=1
#   adds the run with the state on the host (`runtime.state_on_device = false`);
#   GPT2_UNTRIED=0 leaves out the run with the kernels not yet run on a GPU
#   (`runtime.cuda_kernels_untried = true`: attention as one operator each way,
#   `compute/cuda_attention.rs`, and `LayerNormGrad`); GPT2_FLASH=0 the run with attention
#   on the flash kernels (`runtime.flash_attention = true`, `compute/kernels/flash.rs`);
#   GPT2_GRAPH=0 the run recorded once as a CUDA graph and replayed
#   (`runtime.cuda_graph = true`, `compute/session/replay.rs`);
#   GPT2_ONEHOT=1 the run without pipetrain's CUDA kernels (`runtime.cuda_kernels = false`:
#   standard ops instead of `RowsAdd`, `TanhGelu` and `SoftmaxGrad`). Every GPU run has
#   `cuda_kernels = true` unless GPU_CHECK_CUDA_KERNELS=false.
# ONNX Runtime's CUDA build comes from ORT_DYLIB_PATH or `scripts/setup.sh --cuda`.
# Everything lands in --out (default gpu-check/); the summary is printed at the end.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="" peers="$root/peers/data" out="gpu-check" checks=kernels,curves,pipeline,replicas,resume,precision,gpt2
device=${PIPETRAIN_GPU_CHECK_DEVICE:-cuda}
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift 2 ;;
    --peers) peers=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --quick) checks=curves,pipeline,replicas,resume,precision; shift ;;
    --checks) checks=$2; shift 2 ;;
    *) echo "gpu-check: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  (cd "$root" && cargo build --release --features cli,cuda) || exit 1
  bin="$root/target/release"
fi
bin=$(cd "$bin" && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
pt="$bin/pipetrain" summary="$out/summary.txt" fails=0
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
fail() { say "FAIL: $*"; fails=$((fails + 1)); }
want() { [[ ",$checks," == *",$1,"* ]]; }

"$pt" doctor 2>&1 | tee "$out/doctor.txt"
if [ "$device" = cuda ] && ! grep -q '^cuda:0:' "$out/doctor.txt"; then
  say "no GPU found (see doctor.txt): the GPU checks are skipped"
  exit 0
fi
say "device: $(grep -m1 '^cuda:0:' "$out/doctor.txt" || echo "$device")"
grep -E '^(provider|nccl|cublas|flash|gpu path):' "$out/doctor.txt" >> "$summary"
grep -q 'nccl:.*ok' "$out/doctor.txt" || [ "$device" != cuda ] || fail "nccl self-check"

# A configuration from examples/NAME.toml on DEVICE: the peers' files from $peers, runs
# under $out; extra top-level lines first.
config() { # NAME DEVICE TAG [EXTRA...]
  local name=$1 dev=$2 tag=$3; shift 3
  local cfg="$out/cfg/$tag.toml"; mkdir -p "$out/cfg"
  { printf '%s\n' "$@"
    sed -e "s#\.\./peers/data#$peers#g" -e "s#\.\./runs/[a-z_]*/#$out/runs/$tag/#g" \
      "$root/examples/$name.toml"
    printf '\n[runtime]\ndevice = "%s"\ncuda_kernels = %s\n' "$dev" "${GPU_CHECK_CUDA_KERNELS:-true}"; } > "$cfg"
  echo "$cfg"
}
train() { # TAG CONFIG [ARGS...]
  local tag=$1 cfg=$2; shift 2
  timeout -k 10 "${TRAIN_TIMEOUT:-600}" "$pt" train "$cfg" --metrics "$out/$tag.jsonl" "$@" > "$out/$tag.log" 2>&1 \
    || { fail "$tag (see $tag.log)"; tail -5 "$out/$tag.log"; return 1; }
}

# The device kernels against the CPU's formulas, from the library's test executable.
if want kernels; then
  lib=$(ls "$bin"/pipetrain-* 2>/dev/null | head -1)
  if [ -z "$lib" ] && [ -z "${PIPETRAIN_GPU_CHECK_NO_BUILD:-}" ]; then
    lib=$(cd "$root" && cargo test --release --lib --features cuda --no-run --message-format=json 2>/dev/null \
      | python3 -c 'import json,sys
for l in sys.stdin:
    o = json.loads(l)
    if o.get("reason") == "compiler-artifact" and o.get("executable"): print(o["executable"])' | tail -1)
  fi
  if [ -n "$lib" ] && PIPETRAIN_REQUIRE_NVRTC=1 "$lib" --test-threads 1 --nocapture compute::cuda_ compute::session::bound::tests::on_a_gpu compute::session::replay::tests::on_a_gpu > "$out/kernels.log" 2>&1 \
      && ! grep -q 'skipped' "$out/kernels.log"; then
    say "kernels: $(grep -c '\.\.\. ok' "$out/kernels.log") device tests passed (update bitwise the CPU's, norm repeatable, RowsAdd bitwise its formula, TanhGelu/SoftmaxGrad their formulas, LayerNormGrad the CPU kernel's, KeyedDropout the CPU's masks, a value left on the device fed to the next session, a session replayed as a CUDA graph on new inputs each run, NVRTC compiles)"
  else
    fail "kernels (see kernels.log)"; tail -5 "$out/kernels.log"
  fi
  # Attention alone, its two GPU forms side by side (a measurement the tests leave out).
  if [ -n "$lib" ] && [ "${KERNELS_ATTENTION_TIMING:-1}" = 1 ]; then
    timeout 120 "$lib" --test-threads 1 --nocapture --ignored \
      compute::cuda_attention::tests::on_a_gpu_time_the_attention_forms > "$out/attention_timing.log" 2>&1
    grep -h 'attention timing' "$out/attention_timing.log" >> "$summary" \
      || fail "attention timing (see attention_timing.log)"
  fi
fi

# Loss curves on the GPU, judged against the peers' PyTorch float64 curve (the CPU run beside it
# for comparison; TF32 off on the GPU).
want curves && for run in mlp_sgd mlp_adamw tiny_gpt_sgd tiny_gpt_adamw; do
  train "${run}_cpu" "$(config $run cpu ${run}_cpu)" || continue
  train "${run}_gpu" "$(config $run "$device" ${run}_gpu)" || continue
  ref="$peers/../results/loss_$run.csv"; [ -f "$ref" ] || ref=""
  python3 "$root/benches/gpu/curves.py" "$run" "$out/${run}_gpu.jsonl" "$out/${run}_cpu.jsonl" \
    $ref --tol 1e-4 >> "$summary" || fails=$((fails + 1))
done

# Two pipeline stages on one GPU: a stream each; how long they computed at once.
if want pipeline && RUST_LOG=info,pipetrain::device=debug train mlp_pipeline_gpu \
    "$(config mlp_pipeline "$device" mlp_pipeline_gpu)" --chrome-trace "$out/mlp_pipeline_gpu.trace.json"; then
  python3 "$root/benches/gpu/overlap.py" "$out/mlp_pipeline_gpu.trace.json" | sed 's/^/pp=2 /' >> "$summary"
  # What goes through the host: the data in, the losses and norms out; the stage
  # messages and the stash stay on the device. Counted on the CPU over host memory
  # (`debug.device_path_on_host`), this run's step: 0.66 MB in and 0.26 MB out with the
  # messages through the host, 0.40 MB in (the data) and 32 bytes out without.
  python3 "$root/benches/gpu/traffic.py" "pp=2 host traffic" "$out/mlp_pipeline_gpu.log" >> "$summary"
  # Its micro-batches' gradients added on the device against on the host: the same bits.
  host=$(config mlp_pipeline "$device" mlp_pipeline_host)
  sed -i 's/^\[runtime\]/[runtime]\nstate_on_device = false/' "$host"
  train mlp_pipeline_host "$host" && python3 "$root/benches/gpu/losses_diff.py" \
    "pp=2, 4 micro-batches, state on the device against the host" \
    "$out/mlp_pipeline_gpu.jsonl" "$out/mlp_pipeline_host.jsonl" >> "$summary"
fi

# Four pipeline stages on one GPU (the peers' MLP, 1F1B, 4 micro-batches of 16): how long
# two, three and four stages' streams computed at once, and its host traffic
# (PIPELINE_PP4=0: not).
if want pipeline && [ "${PIPELINE_PP4:-1}" = 1 ]; then
  pp4=$(config mlp_pipeline "$device" pp4_gpu)
  sed -i -e 's/^pipeline_parallel_size = .*/pipeline_parallel_size = 4/' -e 's/^num_train_steps = .*/num_train_steps = 160/' "$pp4"
  RUST_LOG=info,pipetrain::device=debug train pp4_gpu "$pp4" --chrome-trace "$out/pp4_gpu.trace.json" \
    && python3 "$root/benches/gpu/overlap.py" "$out/pp4_gpu.trace.json" | sed 's/^/pp=4 /' >> "$summary" \
    && python3 "$root/benches/gpu/traffic.py" "pp=4 host traffic" "$out/pp4_gpu.log" >> "$summary"
fi

# Two data-parallel replicas on one GPU: their gradients summed in device memory against
# the same run with the state (and the sum) on the host; and what each step copied.
if want replicas; then
  dp2=$(config tiny_gpt_adamw "$device" dp2_gpu "data_parallel_size = 2")
  dp2_host=$(config tiny_gpt_adamw "$device" dp2_host "data_parallel_size = 2")
  sed -i 's/^\[runtime\]/[runtime]\nstate_on_device = false/' "$dp2_host"
  if RUST_LOG=info,pipetrain::device=debug train dp2_gpu "$dp2" && train dp2_host "$dp2_host"; then
    grep -q 'sum their gradients in device memory' "$out/dp2_gpu.log" \
      || fail "dp=2: the replicas did not sum in device memory (see dp2_gpu.log)"
    python3 "$root/benches/gpu/losses_diff.py" \
      "dp=2 on one GPU, gradients summed in device memory against on the host" \
      "$out/dp2_gpu.jsonl" "$out/dp2_host.jsonl" >> "$summary"
    python3 "$root/benches/gpu/traffic.py" "dp=2 host traffic" "$out/dp2_gpu.log" >> "$summary"
  fi
  # The step's NCCL all-reduce through a one-rank communicator (`debug.nccl_one_rank`):
  # the sum over one rank is the gradients themselves, so the losses are the plain run's.
  one=$(config tiny_gpt_adamw "$device" nccl_one_rank) plain=$(config tiny_gpt_adamw "$device" nccl_plain)
  sed -i 's/^num_train_steps = .*/num_train_steps = 20/' "$one" "$plain"
  printf '\n[debug]\nnccl_one_rank = true\n' >> "$one"
  if RUST_LOG=info train nccl_one_rank "$one" && train nccl_plain "$plain"; then
    grep -q 'one-rank NCCL communicator' "$out/nccl_one_rank.log" \
      || fail "nccl: the one-rank communicator was not in the step (see nccl_one_rank.log)"
    python3 "$root/benches/gpu/losses_diff.py" \
      "the step's NCCL all-reduce over one rank against none" \
      "$out/nccl_one_rank.jsonl" "$out/nccl_plain.jsonl" >> "$summary"
  fi
fi

# Checkpoint and resume on the GPU: steps 11-20 resumed equal steps 11-20 straight.
ck=("checkpoint_period = 10")
straight=$(config tiny_gpt_adamw "$device" resume_straight "checkpoints_dir = \"$out/ck_straight\"" "${ck[@]}")
sed -i 's/^num_train_steps = .*/num_train_steps = 20/' "$straight"
half=$(config tiny_gpt_adamw "$device" resume_half "checkpoints_dir = \"$out/ck_half\"" "${ck[@]}")
sed -i 's/^num_train_steps = .*/num_train_steps = 10/' "$half"
if want resume && train resume_straight "$straight" && train resume_first "$half"; then
  sed -i 's/^num_train_steps = .*/num_train_steps = 20/' "$half"
  if train resume_second "$half" --resume; then
    a=$(sed -n '11,20p' "$out/resume_straight.jsonl" | python3 -c 'import json,sys; print([json.loads(l)["loss"] for l in sys.stdin])')
    b=$(python3 -c 'import json,sys; print([json.loads(l)["loss"] for l in open(sys.argv[1]) if l.strip()][-10:])' "$out/resume_second.jsonl")
    last=step-00000020 same=1
    for f in "$out/ck_straight/$last"/*.safetensors; do
      cmp -s "$f" "$out/ck_half/$last/$(basename "$f")" || same=0
    done
    ls "$out/ck_straight/$last"/*.safetensors > /dev/null 2>&1 || same=0
    if [ "$a" = "$b" ] && [ "$same" = 1 ]; then
      say "resume: steps 11-20 losses, and the step-20 weights and optimizer state, bitwise equal"
    else
      fail "resume: losses straight $a, resumed $b; checkpoint files equal: $same"
    fi
  fi
fi

# The same run twice on the GPU: bitwise the same losses and step-20 state? (Resume
# cannot be more exact than this.)
if want resume; then
  again=$(config tiny_gpt_adamw "$device" resume_again "checkpoints_dir = \"$out/ck_again\"" "${ck[@]}")
  sed -i 's/^num_train_steps = .*/num_train_steps = 20/' "$again"
  if train resume_again "$again"; then
    same=1
    for f in "$out/ck_straight/step-00000020"/*.safetensors; do
      cmp -s "$f" "$out/ck_again/step-00000020/$(basename "$f")" || same=0
    done
    python3 - "$out/resume_straight.jsonl" "$out/resume_again.jsonl" "$same" <<'PY' >> "$summary"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p) if l.strip()] for p in sys.argv[1:3])
diff = [i + 1 for i in range(min(len(a), len(b))) if a[i] != b[i]]
state = "equal" if sys.argv[3] == "1" else "different"
print(f"repeat: the same 20 steps run twice: losses {'bitwise equal' if not diff else f'first differ at step {diff[0]}'}, step-20 state {state}")
PY
  fi
fi

# Mixed precision on the GPU: the tiny GPT under AdamW in float16 (dynamic loss scale) and
# bfloat16 against float32, and a float16 run with an overflow injected at step 5.
if want precision; then
  mp() { config tiny_gpt_adamw "$device" "mp_$1" "${@:2}"; }
  f32=$(mp f32) f16=$(mp f16 "use_mixed_precision = true" "loss_scale = 0")
  bf16=$(mp bf16 "use_mixed_precision = true" "use_bfloat16 = true")
  over=$(mp overflow "use_mixed_precision = true" "loss_scale = 0")
  sed -i 's/^num_train_steps = .*/num_train_steps = 20/' "$over"
  printf '\n[[debug.inject_grad_overflow]]\nstep = 5\nstage = 0\n' >> "$over"
  if train mp_f32 "$f32" && train mp_f16 "$f16" && train mp_bf16 "$bf16" && train mp_overflow "$over"; then
    python3 "$root/benches/gpu/precision.py" "$out/mp_f32.jsonl" "$out/mp_f16.jsonl" \
      "$out/mp_bf16.jsonl" "$out/mp_overflow.jsonl" 5 --tol "${PRECISION_TOL:-0.05}" >> "$summary" \
      || fails=$((fails + 1))
  fi
fi

# GPT-2 small: tokens/s of pipetrain, and of PyTorch eager on the same model.
if want gpt2; then
  batch=${GPT2_BATCH:-4} steps=${GPT2_STEPS:-12} layers=${GPT2_LAYERS:-12} d=${GPT2_D:-768}
  heads=${GPT2_HEADS:-12} seq=${GPT2_SEQ:-1024} vocab=${GPT2_VOCAB:-50257}
  # The parameters that take part in products, for model FLOPs (benches/gpu/peak.py):
  # the blocks and the LM head; the token and position embeddings are lookups.
  params=$((layers * 12 * d * d + vocab * d))
  cat > "$out/cfg/gpt2_small.toml" <<EOF
batch_size = $batch
num_train_steps = $steps
display_loss_steps = 1
[model]
kind = "gpt2"
layers = $layers
d_model = $d
heads = $heads
vocab = $vocab
seq = $seq
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "targets"
[data]
synth = { kind = "language", samples = $((batch * 4)), seq = $seq, vocab = $vocab, seed = 7 }
layout = { kind = "next_token", array = "tokens", input = "tokens", label = "targets" }
[optimizer]
kind = "sgd"
[lr_schedule]
kind = "constant"
lr = 1e-4
[runtime]
device = "$device"
cuda_kernels = ${GPU_CHECK_CUDA_KERNELS:-true}
EOF
  if TRAIN_TIMEOUT=${GPT2_TIMEOUT:-300} train gpt2_small "$out/cfg/gpt2_small.toml" \
      --chrome-trace "$out/gpt2_small.trace.json"; then
    python3 "$root/benches/gpu/gpt2_speed.py" "$out/gpt2_small.jsonl" $((batch * seq)) "$params" "$layers" "$d" "$seq" >> "$summary"
    # Where a step goes: the session run (F, parameters in and gradients out included)
    # against the optimizer (STEP); then ONNX Runtime's own profile of a few steps.
    python3 "$root/benches/gpu/trace_summary.py" "$out/gpt2_small.trace.json" | sed 's/^/gpt2 trace /' >> "$summary"
    # What pipetrain handed between host and device in the last step (with
    # RUST_LOG=pipetrain::device=debug; ONNX Runtime's own copies inside a run not seen).
    sed 's/\x1b\[[0-9;]*m//g' "$out/gpt2_small.log" | grep 'host traffic of the step' | tail -1 \
      | grep -o 'to_device=[0-9]* to_host=[0-9]*' | sed 's/^/gpt2 host traffic per step (bytes): /' >> "$summary"
  fi
  # PyTorch eager on the same model and batch, first (a call's time limit cuts the end).
  if python3 -c 'import torch, transformers' 2>/dev/null; then
    python3 "$root/benches/gpu/gpt2_eager.py" --batch "$batch" --steps "$steps" --mfu-params "$params" \
      --layers "$layers" --d "$d" --heads "$heads" --seq "$seq" --vocab "$vocab" >> "$summary" 2>"$out/gpt2_eager.err" \
      || fail "gpt2 eager (see gpt2_eager.err)"
    [ -z "${GPT2_HALF:-}" ] || python3 "$root/benches/gpu/gpt2_eager.py" --batch "$batch" --steps "$steps" --mfu-params "$params" --autocast "${GPT2_HALF:-}" \
      --layers "$layers" --d "$d" --heads "$heads" --seq "$seq" --vocab "$vocab" >> "$summary" 2>"$out/gpt2_eager.err" \
      || fail "gpt2 eager ${GPT2_HALF:-} (see gpt2_eager.err)"
  else
    say "gpt2 eager: PyTorch or transformers not installed: skipped"
  fi
  # Mixed precision (GPT2_HALF=bf16 or f16): pipetrain's use_mixed_precision against
  # PyTorch eager under torch.autocast (before the variants: a call's time limit has cut
  # it when it came last).
  half=${GPT2_HALF:-}
  if [ -n "$half" ]; then
    { echo "use_mixed_precision = true"
      if [ "$half" = bf16 ]; then echo "use_bfloat16 = true"; else echo "loss_scale = 0"; fi
      cat "$out/cfg/gpt2_small.toml"; } > "$out/cfg/gpt2_$half.toml"
    if TRAIN_TIMEOUT=${GPT2_TIMEOUT:-300} train "gpt2_$half" "$out/cfg/gpt2_$half.toml"; then
      python3 "$root/benches/gpu/gpt2_speed.py" "$out/gpt2_$half.jsonl" $((batch * seq)) "$params" "$layers" "$d" "$seq" "$half" \
        | sed "s/^pipetrain/pipetrain, $half mixed precision/" >> "$summary"
    fi
  fi
  # A variant of that run: its configuration edited by SED, its speed labelled LABEL.
  gpt2_variant() { # TAG SED LABEL
    sed "$2" "$out/cfg/gpt2_small.toml" > "$out/cfg/gpt2_$1.toml"
    TRAIN_TIMEOUT=${GPT2_TIMEOUT:-300} train "gpt2_$1" "$out/cfg/gpt2_$1.toml" || return 1
    python3 "$root/benches/gpu/gpt2_speed.py" "$out/gpt2_$1.jsonl" $((batch * seq)) "$params" "$layers" "$d" "$seq" \
      | sed "s/^pipetrain/pipetrain, $3/" >> "$summary"
  }
  # Before the state moved to the device: the same run with it on the host.
  [ "${GPT2_HOST:-0}" = 1 ] \
    && gpt2_variant host 's/^\[runtime\]/[runtime]\nstate_on_device = false/' "state on the host" \
    && python3 "$root/benches/gpu/losses_diff.py" "gpt2, state on the device against the host" \
      "$out/gpt2_small.jsonl" "$out/gpt2_host.jsonl" >> "$summary"
  # pipetrain's CUDA kernels against standard ops (the one-hot embedding gradient).
  [ "${GPT2_ONEHOT:-0}" = 1 ] \
    && gpt2_variant onehot 's/^cuda_kernels = .*/cuda_kernels = false/' "standard ops (cuda_kernels = false: one-hot embedding gradient, GELU and softmax backward node by node)" \
    && python3 "$root/benches/gpu/losses_diff.py" "gpt2, pipetrain's CUDA kernels (RowsAdd, TanhGelu, SoftmaxGrad) against standard ops" \
      "$out/gpt2_small.jsonl" "$out/gpt2_onehot.jsonl" >> "$summary"
  # The step recorded once as a CUDA graph and replayed (runtime.cuda_graph, off by
  # default until measured here): its speed, its losses against the default run's (the
  # same kernels in the same order: bitwise expected), and how many runs were replays.
  [ "${GPT2_GRAPH:-1}" = 1 ] \
    && RUST_LOG=${RUST_LOG:-warn},pipetrain::device=debug gpt2_variant graph 's/^\[runtime\]/[runtime]\ncuda_graph = true/' "replayed as a CUDA graph (cuda_graph = true)" \
    && python3 "$root/benches/gpu/losses_diff.py" "gpt2, cuda_graph against the default run" \
      "$out/gpt2_small.jsonl" "$out/gpt2_graph.jsonl" >> "$summary" \
    && echo "gpt2 graph: $(sed 's/\x1b\[[0-9;]*m//g' "$out/gpt2_graph.log" | grep -c 'as a CUDA graph.* graph=1') runs under graph 1" >> "$summary"
  # The kernels not yet run on a GPU (runtime.cuda_kernels_untried, off by default until
  # measured here: attention as one operator each way, LayerNormGrad): their speed, and
  # their losses against the default run's (float32 noise).
  [ "${GPT2_UNTRIED:-1}" = 1 ] \
    && gpt2_variant untried 's/^cuda_kernels = .*/cuda_kernels = true\ncuda_kernels_untried = true/' "untried kernels (cuda_kernels_untried = true: attention, LayerNormGrad)" \
    && python3 "$root/benches/gpu/losses_diff.py" "gpt2, cuda_kernels_untried against the default kernels" \
      "$out/gpt2_small.jsonl" "$out/gpt2_untried.jsonl" >> "$summary" \
    && sed 's/\x1b\[[0-9;]*m//g' "$out/gpt2_untried.log" | grep -o '[0-9]* attentions as one CUDA operator' \
      | head -1 | sed 's/^/gpt2 untried: /' >> "$summary"
  # Attention on the flash kernels (runtime.flash_attention, with the untried ones):
  # its speed, and its losses against the default run's.
  [ "${GPT2_FLASH:-1}" = 1 ] \
    && gpt2_variant flash 's/^cuda_kernels = .*/cuda_kernels = true\ncuda_kernels_untried = true\nflash_attention = true/' "flash attention (flash_attention = true, with the untried kernels)" \
    && python3 "$root/benches/gpu/losses_diff.py" "gpt2, flash_attention against the default kernels" \
      "$out/gpt2_small.jsonl" "$out/gpt2_flash.jsonl" >> "$summary" \
    && sed 's/\x1b\[[0-9;]*m//g' "$out/gpt2_flash.log" | grep -o '[0-9]* of them on the flash kernels' \
      | head -1 | sed 's/^/gpt2 flash: /' >> "$summary"
  # The price of runtime.deterministic (on by default): the same run with it off.
  [ "${GPT2_UNORDERED:-1}" = 1 ] \
    && gpt2_variant unordered 's/^\[runtime\]/[runtime]\ndeterministic = false/' "deterministic = false"
  if [ "${GPT2_PROFILE:-1}" = 1 ] && [ -f "$out/gpt2_small.jsonl" ]; then
    sed -e 's/^num_train_steps = .*/num_train_steps = 4/' -e 's/^\[runtime\]/[runtime]\nprofile = true/' \
      "$out/cfg/gpt2_small.toml" > "$out/cfg/gpt2_profiled.toml"
    if (cd "$out" && TRAIN_TIMEOUT=${GPT2_TIMEOUT:-300} train gpt2_profiled "$out/cfg/gpt2_profiled.toml"); then
      for f in "$out"/pipetrain_*forward_backward*.json; do
        python3 "$root/benches/ort_profile.py" --skip 1 "$f" 2>&1 | head -25 | sed 's/^/gpt2 ort /' >> "$summary"
      done
    fi
  fi
fi

echo; echo "== gpu-check summary ($summary)"; cat "$summary"
[ "$fails" = 0 ]
