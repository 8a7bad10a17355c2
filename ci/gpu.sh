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

docker_run=(docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864
            -v "$workdir:/work" "$image")

echo "== doctor inside the image (CUDA, NCCL, Apex and Triton must all be usable)"
"${docker_run[@]}" python -m megatron_core.doctor --require cuda,nccl,apex,triton

echo "== kernel tests on the GPU"
"${docker_run[@]}" python -m pytest -q -p no:cacheprovider tests -k "fusion or kernel or triton or apex"

echo "== GPU smoke run"
invoke docker.run --image "$image" --recipe smoke --gpus 1 --workdir "$workdir" \
  --set training.device=cuda --set training.fusions=auto
"${docker_run[@]}" python -m ci.golden sanity --recipe smoke --workdir /work \
  --set training.device=cuda --set training.fusions=auto
echo "gpu: ok"
