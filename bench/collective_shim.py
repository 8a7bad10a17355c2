"""Run a module with every torch.distributed collective checked: its tensors must be on one device type.

    torchrun --nproc-per-node 8 -m bench.collective_shim --expect-device cuda --report DIR \\
        megatron_core.pretrain_gpt --recipe ... [its own arguments]

What it proves: NCCL takes CUDA tensors only, so a collective handed a CPU tensor (a stop flag, a grad
norm, a p2p buffer made on the wrong device) fails on the first multi-GPU run. Under this shim several
ranks can share ONE GPU (MEGATRON_DISTRIBUTED_BACKEND=gloo, since NCCL refuses two ranks on a device):
each collective first asserts that every tensor it was handed is on `--expect-device`, then gloo carries
the bytes through CPU copies (synchronously; an async call returns a finished handle), and the results
are copied back into the caller's tensors. The copies are made on a CPU run too, so the CPU run of
bench/gpu_check.py exercises the same staging path the GPU run takes.

Each rank writes `DIR/collectives-rank<R>.json` (calls per collective, and the first device mismatch) at
exit, so the check can tell "no collective was wrong" from "no collective ran".
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

CALLS: Counter = Counter()
MISMATCHES: list[str] = []


class _Finished:
    """What an async collective returns once it has run synchronously."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the Work API
        return True

    def is_completed(self) -> bool:
        return True


def _check(op: str, tensors, expect: str) -> None:
    CALLS[op] += 1
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != expect:
            problem = f"{op}: a {tuple(t.shape)} {t.dtype} tensor on {t.device}, expected {expect}"
            MISMATCHES.append(problem)
            raise AssertionError(f"collective device check: {problem}")


def _staged(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def install(expect: str) -> None:
    """Replace the collectives megatron_core calls (looked up on torch.distributed at call time)."""
    orig = {
        name: getattr(dist, name)
        for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv")
    }

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _check("all_reduce", [tensor], expect)
        cpu = _staged(tensor)
        orig["all_reduce"](cpu, op=op, group=group)
        tensor.copy_(cpu)
        return _Finished() if async_op else None

    def broadcast(tensor, src=None, group=None, async_op=False, **kwargs):
        _check("broadcast", [tensor], expect)
        cpu = _staged(tensor)
        orig["broadcast"](cpu, src=src, group=group, **kwargs)
        tensor.copy_(cpu)
        return _Finished() if async_op else None

    def all_gather_into_tensor(output, input, group=None, async_op=False):  # noqa: A002 - torch's name
        _check("all_gather_into_tensor", [output, input], expect)
        out = _staged(output)
        orig["all_gather_into_tensor"](out, _staged(input), group=group)
        output.copy_(out)
        return _Finished() if async_op else None

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
        _check("reduce_scatter_tensor", [output, input], expect)
        out = _staged(output)
        orig["reduce_scatter_tensor"](out, _staged(input), op=op, group=group)
        output.copy_(out)
        return _Finished() if async_op else None

    def batch_isend_irecv(p2p_op_list):
        _check("batch_isend_irecv", [p.tensor for p in p2p_op_list], expect)
        staged = [(p, _staged(p.tensor)) for p in p2p_op_list]
        works = orig["batch_isend_irecv"]([dist.P2POp(p.op, cpu, p.peer, p.group, p.tag) for p, cpu in staged])
        for work in works:
            work.wait()
        for p, cpu in staged:
            if p.op.__name__ == "irecv":
                p.tensor.copy_(cpu)
        return [_Finished() for _ in works]

    for name, fn in (
        ("all_reduce", all_reduce),
        ("broadcast", broadcast),
        ("all_gather_into_tensor", all_gather_into_tensor),
        ("reduce_scatter_tensor", reduce_scatter_tensor),
        ("batch_isend_irecv", batch_isend_irecv),
    ):
        setattr(dist, name, fn)


def _write_report(report_dir: Path) -> None:
    rank = int(os.environ.get("RANK", "0"))
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"collectives-rank{rank}.json").write_text(
        json.dumps({"rank": rank, "calls": dict(CALLS), "mismatches": MISMATCHES})
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.collective_shim", description=__doc__.splitlines()[0])
    parser.add_argument("--expect-device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--report", required=True, help="directory for collectives-rank<R>.json")
    parser.add_argument("module", help="the module to run as __main__, e.g. megatron_core.pretrain_gpt")
    args, rest = parser.parse_known_args(argv)
    install(args.expect_device)
    atexit.register(_write_report, Path(args.report))
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
