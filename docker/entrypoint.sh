#!/usr/bin/env bash
# Entrypoint of the megatron-recipes image: make the cache directories on the /cache volume, warn about the
# two container settings whose absence breaks multi-GPU runs in ways that are hard to read later (a small
# /dev/shm, a locked-memory limit), then hand over to NVIDIA's entrypoint (its banner, driver checks) or,
# outside an NGC image, run the command itself.
set -euo pipefail

warn() { echo "[entrypoint] warning: $*" >&2; }

for dir in "${HF_HOME:-}" "${HF_DATASETS_CACHE:-}" "${TRITON_CACHE_DIR:-}" "${TORCHINDUCTOR_CACHE_DIR:-}"; do
  if [ -n "$dir" ] && ! mkdir -p "$dir" 2>/dev/null; then
    warn "cannot create cache directory $dir; mount a writable volume there (e.g. -v \$HOME/.cache/megatron-recipes:/cache)"
  fi
done

# Docker's default /dev/shm is 64 MiB: NCCL and data-loader workers need far more.
shm_kib=$(df -kP /dev/shm 2>/dev/null | awk 'NR == 2 {print $2}')
if [ -n "${shm_kib}" ] && [ "${shm_kib}" -lt 1048576 ]; then
  warn "/dev/shm is only $((shm_kib / 1024)) MiB; run the container with --ipc=host (invoke docker.run does)"
fi

memlock=$(ulimit -l)
if [ "${memlock}" != "unlimited" ]; then
  warn "locked memory is limited to ${memlock} KiB (InfiniBand/RDMA needs more); run with --ulimit memlock=-1"
fi

if [ "$#" -eq 0 ]; then
  set -- python -m megatron_core.doctor
fi

NVIDIA_ENTRYPOINT=${NVIDIA_ENTRYPOINT:-/opt/nvidia/nvidia_entrypoint.sh}
if [ -x "${NVIDIA_ENTRYPOINT}" ]; then
  exec "${NVIDIA_ENTRYPOINT}" "$@"
fi
exec "$@"
