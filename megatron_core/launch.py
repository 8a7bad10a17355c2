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
from pathlib import Path
from typing import Optional, Sequence

from megatron_core.errors import UserError


class LaunchError(UserError):
    """Launch flags that cannot describe a job."""


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range, for a torchrun master. A port the kernel handed out
    (bind to 0) can be handed out again as the local end of any connection (other jobs' gloo ranks open
    dozens) in the seconds before torchrun binds it; below the range only another explicit bind can take it."""
    import random
    import socket
    from pathlib import Path

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(min(10000, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found in [{min(10000, low // 2)}, {low}) after 200 tries")


def _torchrun() -> list[str]:
    """The torchrun of this interpreter's environment (the module form works without the script)."""
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def torchrun_command(
    recipe_spec: str,
    overrides: Sequence[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    rdzv_endpoint: Optional[str] = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
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


def _process_tree(root: int) -> list[int]:
    """`root` and every process below it (torchrun starts each worker in a session of its own, so a
    process group does not reach them), parents first."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            children.setdefault(_parent(int(entry)), []).append(int(entry))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        tree.append(pid)
        queue.extend(children.get(pid, []))
    return tree


def _children(pid: int) -> list[int]:
    import os

    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _parent(int(entry)) == pid]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def run_forwarding_signals(cmd: Sequence[str], grace_s: float = 600.0) -> int:
    """Run the trainer (or torchrun) and return its exit status, forwarding SIGINT and SIGTERM to it.

    The child runs in a session of its own, so a Ctrl-C at the terminal reaches this process only. Each
    signal is forwarded once to the trainers: the child itself when it is the trainer, else the processes
    below it (torchrun's workers), not torchrun, whose own handler would kill its workers after 30 s. The
    trainers save at the end of their iteration and exit; this process waits for them instead of killing
    them midway (what subprocess.call does on KeyboardInterrupt). A job still running `grace_s` seconds
    after the first signal, or at a third signal, gets SIGKILL, the whole tree. The status is the child's,
    except that a job that a forwarded signal ended reports 128 + that signal, the shell's convention
    (torchrun itself exits 1 when its workers stop).
    """
    import os
    import signal
    import subprocess
    import time

    child = subprocess.Popen(list(cmd), start_new_session=True)
    via_torchrun = any(Path(arg).name == "torchrun" or arg == "torch.distributed.run" for arg in list(cmd)[:3])
    received: list[tuple[float, int]] = []  # (when, which) of each signal

    def send(sig: int, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    pending: list[int] = []  # a signal torchrun's workers have not got yet (they were not started)

    def deliver(signum: int) -> None:
        # torchrun's workers are its children (their own children, e.g. compile workers, are theirs)
        targets = _children(child.pid) if via_torchrun else [child.pid]
        send(signum, targets)
        if not targets:
            pending.append(signum)

    def forward(signum, frame):  # noqa: ARG001 - the signal handler's signature
        received.append((time.monotonic(), signum))
        if len(received) >= 3:
            send(signal.SIGKILL, _process_tree(child.pid))
        else:
            deliver(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if pending:
                    deliver(pending.pop())
                if received and time.monotonic() - received[0][0] > grace_s:
                    send(signal.SIGKILL, _process_tree(child.pid))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rc < 0:
        return 128 - rc
    return 128 + received[0][1] if received and rc != 0 else rc
