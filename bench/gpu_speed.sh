#!/usr/bin/env bash
# The GPU speed call (issue 31's figures); the correctness call is `python -m bench.gpu_check` (run it first).
#   1. the environment report (torch, CUDA, NCCL, Apex, Triton);
#   2. every Triton kernel against its PyTorch reference, forward and backward, compiled for this GPU;
#   3. bench.train: CodeParrot-small (12x768x12, seq 1024, micro 12, global 192) in bf16 on one GPU,
#      ours against transformers' GPT2LMHeadModel + torch AdamW (tokens/s, TFLOP/s, MFU, peak memory,
#      fraction_of_gemm); then the same shape with dropout off and a smaller global batch, where the first
#      steps' losses of the two sides must agree (the same-work check is only enforced without dropout);
#   4. bench.drift at that shape: fusions=triton (our Triton softmax and cross entropy, Apex's LayerNorm where
#      Apex imports) against all on torch from the same weights, compared tensor by tensor after 2 steps and
#      forward-only on the third step's batches (weights x fusions);
#   5. bench.kernels: GB/s of each Triton fusion against the measured copy bandwidth, speedup over eager, and the
#      kernels' own (device) time beside the wall time.
# The CodeParrot data and tokenizer come from the Hub; offline, the same model is fed the Python stdlib
# corpus with a 32768-token BPE trained on it (same shapes, same FLOPs). WORK may hold those steps
# already built (bench.train reuses a step whose manifest exists).
# Each part runs under its own time limit and a failing part does not stop the next; the exit status
# says whether all passed. JSON lands in work/bench-results/; the files this run wrote are copied to $OUT
# when it is set.
#
#   bash bench/gpu_speed.sh          # about 7 minutes on one H200; needs torch, triton, transformers
# ONLY='words of a part's name' runs only the parts so named, for a second call.
# On the H200 image (Triton 3.6, NumPy 2.5) test_vocab_parallel_cross_entropy_on_two_gloo_ranks fails inside
# Triton's CPU interpreter (int() of a 1-element array, which NumPy 2.5 refuses), so it is left out here.
# A part that fails stays in the FAILED list even when its fallback passes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
WORK=${WORK:-work/gpu-speed}  # the checkout's own work area, not a path shared in /tmp
ITERS=${ITERS:-6}
if [ -n "${TRITON_INTERPRET:-}" ]; then
  echo "error: TRITON_INTERPRET=$TRITON_INTERPRET is set; this check compiles the kernels for the GPU, unset it" >&2
  exit 2
fi
STARTED=$(mktemp)  # results newer than this file are this run's
trap 'rm -f "$STARTED"' EXIT
FAILED=()

part() {  # part NAME SECONDS COMMAND...: run under a time limit, record a failure, go on
  local name=$1 limit=$2 start rc
  shift 2
  if [ -n "${ONLY:-}" ] && [[ "$name" != *"$ONLY"* ]]; then
    echo "== $name: not run (ONLY=$ONLY)"
    return 0
  fi
  echo "== $name (limit ${limit} s)"
  start=$(date +%s)
  timeout -k 15 "$limit" "$@"
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - start)) s"
  [ "$rc" -eq 0 ] || FAILED+=("$name")
  if [ -n "${OUT:-}" ]; then  # after each part: a run cut short still brings back what it measured
    find work/bench-results -type f -newer "$STARTED" -name '*.json' \( -name 'train-*' -o -name 'kernels-*' -o -name 'drift-*' \) \
      -exec cp {} "$OUT"/ \;
  fi
  return "$rc"
}

# CodeParrot-small in bf16 on the GPU, offline data; a later --set fusions=... wins.
SMALL=(--recipe codeparrot-small-1gpu --workdir "$WORK" --set 'corpus.sources=[{type: python-stdlib}]'
       --set tokenizer.hf_tokenizer=null --set fp16=false --set bf16=true --set device=cuda)
SMALL_BENCH=("$PY" -m bench.train "${SMALL[@]}" --baseline hf --set fusions=auto)

echo "== environment"
"$PY" -m megatron_core.doctor || true
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.cuda.get_device_name())" \
  || exit 1

# Compiled for this GPU on CUDA tensors: the tests fail unless that mode ran. The gloo-rank cross-entropy test
# runs CPU ranks in Triton's interpreter, not the GPU: left out (see the header for why it fails there).
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8" || true)
MEGATRON_FUSIONS_TEST_MODE=compiled part "fused kernels vs references, compiled for this GPU" 120 \
  "$PY" -m pytest -q -p no:cacheprovider $XDIST tests/test_fusions_triton.py tests/test_fusions_reference.py \
  --deselect tests/test_fusions_reference.py::test_vocab_parallel_cross_entropy_on_two_gloo_ranks

part "bench.train codeparrot-small, bf16, one GPU, vs transformers" 240 \
  "${SMALL_BENCH[@]}" --iters "$ITERS" --warmup 2 --repeats 1 --rounds 5 --profile-steps 2
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ]; then  # it broke (not cut off): try without our kernels
  part "bench.train again with fusions=torch (the run above failed)" 180 \
    "${SMALL_BENCH[@]}" --iters "$ITERS" --warmup 2 --repeats 1 --rounds 4 --profile-steps 2 --set fusions=torch
fi

# Dropout off, so the first 3 steps' losses must match transformers' (bench.train raises otherwise).
part "bench.train same-work check: dropout off, global batch 24, fusions=auto" 90 \
  "${SMALL_BENCH[@]}" --iters 2 --warmup 1 --repeats 1 --rounds 2 --profile-steps 0 \
  --set hidden_dropout=0 --set attention_dropout=0 --set global_batch_size=24

# Stop 20 saw all-Triton drift 1.0e-3 from transformers at step 3 (all-torch 2e-6), with the three kernels since
# deleted: does what is left (softmax, cross entropy) drift, and in the update or the forward?
part "bench.drift: fusions=triton against all-torch, global batch 24, 2 steps" 90 \
  "$PY" -m bench.drift "${SMALL[@]}" --set global_batch_size=24 --fusions triton --steps 2

part "bench.kernels bf16" 60 "$PY" -m bench.kernels --dtype bf16 --iters 50


if [ "${#FAILED[@]}" -gt 0 ]; then
  printf 'gpu check: FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "gpu check: ok"
