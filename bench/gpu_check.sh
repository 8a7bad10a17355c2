#!/usr/bin/env bash
# One short GPU session that gives every GPU figure of the fused-kernel issue, checks first, then times:
#   1. the environment report (torch, CUDA, NCCL, Apex, Triton);
#   2. every Triton kernel against its PyTorch reference, forward and backward, compiled for this GPU;
#   3. bench.kernels: GB/s of each fusion against the measured copy bandwidth, and speedup over eager;
#   4. bench.train: CodeParrot-small (12x768x12, seq 1024, micro 12, global 192) in bf16 on one GPU,
#      ours against transformers' GPT2LMHeadModel + torch AdamW (tokens/s, TFLOP/s, MFU, peak memory).
# The CodeParrot data and tokenizer come from the Hub; offline, the same model is fed the Python stdlib
# corpus with a 32768-token BPE trained on it (same shapes, same FLOPs).
# JSON (and the chart) land in bench/results/, and are copied to $OUT when it is set (the device tool).
#
#   bash bench/gpu_check.sh          # about 5 minutes on one H100/H200; needs torch, triton, transformers
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/megatron-recipes-gpu-check}
ITERS=${ITERS:-10}
if [ -n "${TRITON_INTERPRET:-}" ]; then
  echo "error: TRITON_INTERPRET=$TRITON_INTERPRET is set; this check compiles the kernels for the GPU, unset it" >&2
  exit 2
fi

echo "== environment"
"$PY" -m megatron_core.doctor || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.cuda.get_device_name())"

echo "== fused kernels vs references on the GPU (compiled mode required)"
# Compiled for this GPU on CUDA tensors: the test fails unless that mode ran, and prints it.
MEGATRON_FUSIONS_TEST_MODE=compiled "$PY" -m pytest -q -p no:cacheprovider -x tests/test_fusions_triton.py \
  tests/test_fusions_reference.py

echo "== bench.kernels"
"$PY" -m bench.kernels --dtype bf16 --iters 50

echo "== bench.train codeparrot-small, bf16, one GPU, vs transformers"
"$PY" -m bench.train --recipe codeparrot-small-1gpu --workdir "$WORK" --baseline hf \
  --iters "$ITERS" --warmup 3 --repeats 2 \
  --set 'corpus.sources=[{type: python-stdlib}]' --set tokenizer.hf_tokenizer=null \
  --set fp16=false --set bf16=true --set device=cuda --set fusions=auto

if [ -n "${OUT:-}" ]; then
  cp bench/results/kernels-*.json bench/results/train-*.json bench/results/train-*.png "$OUT"/ 2>/dev/null || true
fi
echo "gpu check: ok"
