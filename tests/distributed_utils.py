"""Run a function on N local ranks (gloo, CPU) and collect what each rank returns.

    from distributed_utils import run_distributed      # tests/ is on sys.path under pytest
    results = run_distributed(my_fn, 2, arg1, arg2)   # [rank0_result, rank1_result]

`fn` must be a module-level function (importable, for the `spawn` start method). Inside `fn`, torch.distributed is
initialized (`dist.get_rank()`, `dist.get_world_size()`), torch uses one thread, and the return value may hold
tensors (it is sent back with torch.save). An exception on any rank is raised in the parent with that rank's
traceback; a rank that hangs past `timeout` is killed and reported.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from megatron_core import parallel_state as ps
from megatron_core.distributed.grad_sync import allreduce_embedding_grads, allreduce_sequence_parallel_grads
from megatron_core.distributed.trainable import shared_embedding_parameters
from megatron_core.launch import free_port

DEFAULT_TIMEOUT_S = 300.0  # a hang guard, not a speed check: .ci/run runs two test files at once on 2 cores


def _child(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = fn(*args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron_core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:  # noqa: BLE001 - teardown must not hide the real result
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    start_method: str = "fork",
) -> list:
    """Run `fn(*args)` on `world_size` ranks; return the list of return values by rank.

    `fork` (the default) starts ranks in milliseconds instead of re-importing torch in each
    (seconds on a busy machine), as DataLoader workers do; pass "spawn" for code that is not
    fork-safe (CUDA initialized in the parent)."""
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, backend, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(collected) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise TimeoutError(
                    f"run_distributed({fn.__name__}): ranks {missing} did not finish "
                    f"within {timeout:.0f}s" + ("".join(failures) and "\n" + "\n".join(failures))
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in collected]
                if dead and results.empty():
                    time.sleep(0.5)  # a result may still be in flight from a rank that just exited
                    if results.empty():
                        raise RuntimeError(
                            f"run_distributed({fn.__name__}): rank(s) {dead} exited with codes "
                            f"{[procs[i].exitcode for i in dead]} without a result"
                        ) from None
                continue
            if ok:
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                # The other ranks are probably blocked in a collective with the failed one.
                break
        if failures:
            raise RuntimeError(f"run_distributed({fn.__name__}) failed:\n" + "\n".join(failures))
        return [collected[r] for r in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()


class LocalModel(torch.nn.Module):
    """The model protocol (megatron_core/distributed/trainable.py) at DP = 1 without the data-parallel
    wrapper, for tests that drive the schedules: gradients stay in `.grad` (the
    optimizer's zero_grad clears them), and finishing the sync is the model-parallel sums alone:
    sequence-parallel parameters over TP, the tied word embedding over the embedding group."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    @property
    def chunks(self) -> Sequence[torch.nn.Module]:
        return self.module.chunks

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def zero_grad_buffer(self) -> None:
        """Nothing to do: the gradients are the parameters' own `.grad`."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        if ps.get_data_parallel_world_size() > 1:
            raise TypeError(
                "data-parallel size > 1 but the model is not wrapped in "
                "megatron_core.distributed.DistributedDataParallel; its gradients would not be averaged"
            )
        allreduce_sequence_parallel_grads(self.module.parameters())  # only those marked sequence_parallel
        allreduce_embedding_grads(shared_embedding_parameters(self.module))

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
