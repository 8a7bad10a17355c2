"""The torchrun command line of a training run (what `invoke train` and ci/slurm/train.sbatch run).

    torchrun_command(recipe_spec, overrides, nproc, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                     master_port=29500, rdzv_endpoint=None, extra_args=()) -> list[str]

One node: `torchrun --nproc-per-node N --nnodes 1 --node-rank 0 --master-addr A --master-port P
-m megatron_core.pretrain_gpt --recipe R [--set k=v ...] --set parallel.world_size=N*nnodes [extra]`.
Several nodes: the same on every node with its own --node-rank, or with a rendezvous endpoint
(`--rdzv-backend c10d --rdzv-endpoint host:port --rdzv-id <recipe-derived id>`, node ranks then
assigned by torchrun). The world size the processes make is written into the recipe overrides so
the recipe, its hash and the processes agree; the backend (NCCL on GPUs, gloo on a CPU) is chosen
by megatron_core.distributed.init_distributed inside each process.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from typing import Optional, Sequence

from megatron_core.errors import UserError


class LaunchError(UserError):
    """Launch flags that cannot describe a job."""


def _torchrun() -> list[str]:
    """The torchrun of this interpreter's environment (the module form works without the script)."""
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def torchrun_command(recipe_spec: str, overrides: Sequence[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: str = "127.0.0.1", master_port: int = 29500,
                     rdzv_endpoint: Optional[str] = None, extra_args: Sequence[str] = ()) -> list[str]:
    problems = []
    if nproc < 1:
        problems.append(f"--nproc {nproc} must be >= 1 (processes per node)")
    if nnodes < 1:
        problems.append(f"--nnodes {nnodes} must be >= 1")
    if not 0 <= node_rank < max(nnodes, 1):
        problems.append(f"--node-rank {node_rank} must be in [0, {nnodes - 1}] for --nnodes {nnodes}")
    if not 0 < int(master_port) < 65536:
        problems.append(f"--master-port {master_port} is not a TCP port (1..65535)")
    if rdzv_endpoint is not None and ":" not in rdzv_endpoint:
        problems.append(f"--rdzv-endpoint {rdzv_endpoint!r} must be host:port")
    if problems:
        raise LaunchError("; ".join(problems))
    cmd = _torchrun() + [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if rdzv_endpoint:
        job_id = hashlib.sha256(f"{recipe_spec}|{list(overrides)}".encode()).hexdigest()[:12]
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id=megatron-{job_id}"]
    else:
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={int(master_port)}"]
    cmd += ["-m", "megatron_core.pretrain_gpt", "--recipe", str(recipe_spec)]
    for item in overrides:
        cmd += ["--set", item]
    cmd += ["--set", f"parallel.world_size={nproc * nnodes}"]
    return cmd + list(extra_args)


def run_forwarding_signals(cmd: Sequence[str], grace_s: float = 600.0) -> int:
    """Run the trainer (or torchrun) and return its exit status, forwarding SIGINT and SIGTERM to it.

    The child runs in its own process group, so a Ctrl-C at the terminal reaches this process only, and
    each signal is forwarded to the child's whole group exactly once (torchrun and its workers): the
    trainer saves at the end of its iteration and exits, and this process waits for it instead of killing
    it midway (what subprocess.call does on KeyboardInterrupt). A job still running `grace_s` seconds
    after the first signal, or at a third signal, gets SIGKILL. A child killed by a signal is reported as
    128 + that signal, the shell's convention.
    """
    import os
    import signal
    import subprocess
    import time

    child = subprocess.Popen(list(cmd), start_new_session=True)
    received: list[float] = []  # when each signal came

    def forward(signum, frame):  # noqa: ARG001 - the signal handler's signature
        received.append(time.monotonic())
        try:
            os.killpg(child.pid, signal.SIGKILL if len(received) >= 3 else signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if received and time.monotonic() - received[0] > grace_s:
                    os.killpg(child.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc
