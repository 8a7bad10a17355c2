#!/usr/bin/env bash
# Entrypoint of the megatron-recipes image: run as the owner of /work (so the run's outputs belong to the
# caller), make the cache directories on the /cache volume, warn about the two container settings whose
# absence breaks multi-GPU runs in ways that are hard to read later (a small /dev/shm, a locked-memory
# limit), then hand over to NVIDIA's entrypoint (its banner, driver checks) or, outside an NGC image, run
# the command itself.
set -euo pipefail

warn() { echo "[entrypoint] warning: $*" >&2; }

# Started as root (a plain `docker run`; invoke docker.run passes --user uid:gid already): start again as
# the uid:gid owning the mounted /work, so nothing the run writes there belongs to root.
work=${MEGATRON_WORK_DIR:-/work}
if [ "$(id -u)" = 0 ] && owner=$(stat -c %u:%g "$work" 2>/dev/null) && [ "${owner%%:*}" != 0 ]; then
  exec setpriv --reuid="${owner%%:*}" --regid="${owner##*:}" --clear-groups -- bash "$0" "$@"
fi
if [ "$(id -u)" = 0 ] && [ -d "$work" ]; then
  warn "running as root: $work is owned by root, so the run's files there will be too;" \
    "run with --user \$(id -u):\$(id -g)"
fi
# A uid the image has no account for: give it a writable HOME and a user name (Python's getpass asks).
if [ ! -w "${HOME:-/}" ]; then
  HOME=/tmp/home-$(id -u)
  export HOME
  mkdir -p "$HOME"
fi
if ! id -un >/dev/null 2>&1; then
  export USER=uid$(id -u) LOGNAME=uid$(id -u)
fi

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
