#!/usr/bin/env bash
# GPU job (a self-hosted runner with Docker and the NVIDIA container toolkit): build the image, run the
# kernel tests inside it on the GPU, then a GPU smoke run checked for finite, decreasing losses.
# Usage: ci/gpu.sh [IMAGE_TAG]    (default megatron-recipes:ci-<short git sha>)
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-megatron-recipes:ci-$(git rev-parse --short HEAD)}
workdir=$(mktemp -d "${RUNNER_TEMP:-/tmp}/gpu-smoke.XXXXXX")

echo "== build $image"
invoke docker.build --tag "$image"

docker_flags=(--rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 -v "$workdir:/work")
docker_run=(docker run "${docker_flags[@]}" "$image")

echo "== doctor inside the image (CUDA, NCCL, Apex and Triton must all be usable)"
"${docker_run[@]}" python -m megatron_core.doctor --require cuda,nccl,apex,triton

# The image sets no TRITON_INTERPRET, so the Triton kernels are compiled for the GPU and run on CUDA tensors;
# MEGATRON_FUSIONS_TEST_MODE=compiled makes tests/test_fusions_triton.py fail if they would run in the
# interpreter instead, and it prints the mode that ran ("fusion kernel tests: compiled mode ...").
echo "== kernel tests on the GPU (compiled mode required)"
docker run "${docker_flags[@]}" -e MEGATRON_FUSIONS_TEST_MODE=compiled "$image" \
  python -m pytest -q -p no:cacheprovider tests -k "fusion or kernel or triton or apex"

# Twice: `auto` (what users get, see fusions/backends.py) and `triton` (our Triton softmax and cross entropy,
# Apex's LayerNorm, which the image has, and the best other backend for the rest).
for fusions in auto triton; do
  echo "== GPU smoke run, fusions=$fusions"
  invoke docker.run --image "$image" --recipe smoke --gpus 1 --workdir "$workdir" \
    --set training.device=cuda --set training.fusions=$fusions
  "${docker_run[@]}" python -m ci.golden sanity --recipe smoke --workdir /work \
    --set training.device=cuda --set training.fusions=$fusions
done
echo "gpu: ok"
