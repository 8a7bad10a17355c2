"""Batches in Megatron's order, resumable from a sample count, prepared ahead of the device.

Megatron's pretraining sampler: the dataset is already shuffled (GPT indices), so samples are
taken in index order; each global step of `micro_batch_size x dp` samples is split by DP rank.
Starting at `consumed_samples` is all a resume needs to continue exactly where it stopped.

`batch_iterator` returns a `PrefetchingBatches`: one background thread reads and stacks the next
micro batches (pinned when the device is CUDA) into a small queue, and the training thread copies
each with `non_blocking=True`, so the device does not wait for the disk or the collation. Under
tensor parallelism only TP rank 0 reads; it broadcasts each batch to its TP group, as Megatron's
`broadcast_data` does, after a status (batch, end, or the reader's failure) that travels in host memory
over a gloo group: the other ranks learn it without reading a device tensor, so the TP broadcast costs
no host sync. `wait_seconds` is the time the training thread spent waiting for batches
(Megatron's batch-generator timer).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps

_END = object()


_HOST_GROUPS: dict = {}  # TP group -> its gloo twin (the status travels there under NCCL)


def _carries_host_tensors(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _host_group(group):
    """A process group over `group`'s ranks that carries CPU tensors: `group` itself under gloo, else a
    gloo group made once (only its own ranks take part: they build their iterator together)."""
    if _carries_host_tensors(group):
        return group
    if group not in _HOST_GROUPS:
        _HOST_GROUPS[group] = dist.new_group(
            dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True
        )
    return _HOST_GROUPS[group]


def _read_batches(
    dataset, *, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, wrap: bool, pin: bool
) -> Iterator[dict]:
    step = micro_batch_size * dp_size
    start = consumed_samples
    size = len(dataset)
    while True:
        if not wrap and start + step > size:
            return
        items = [dataset[(start + dp_rank * micro_batch_size + i) % size] for i in range(micro_batch_size)]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        yield {key: value.pin_memory() for key, value in batch.items()} if pin else batch
        start += step


def _put(q: "queue.Queue", item, stop: threading.Event) -> bool:
    """Put unless told to stop (then False)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator[dict], q: "queue.Queue", stop: threading.Event) -> None:
    """The background thread: batches, then _END (or the exception that stopped them)."""
    try:
        for batch in source:
            if not _put(q, batch, stop):
                return
        item = _END
    except BaseException as exc:  # noqa: BLE001 - handed to the training thread, raised there
        item = exc
    _put(q, item, stop)


class PrefetchingBatches:
    """Iterator of micro batches (dicts of [micro_batch_size, ...] tensors on `device`)."""

    def __init__(self, source: Optional[Iterator[dict]], device: torch.device, depth: int = 2, tp_group=None) -> None:
        self.device, self.tp_group = device, tp_group
        self.status_group = _host_group(tp_group) if tp_group is not None else None
        # The status lives in host memory and is read through its numpy view: never a device tensor.
        self._status = torch.zeros(1, dtype=torch.int64)
        self._status_host = self._status.numpy()
        self.wait_seconds = 0.0
        self._schema: Optional[list[tuple[str, torch.Size, torch.dtype]]] = None
        self._stop = threading.Event()
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(depth, 1))
        self._thread = None
        if source is not None:  # TP ranks other than 0 read nothing
            self._thread = threading.Thread(
                target=_produce, args=(source, self._queue, self._stop), daemon=True, name="batch-prefetch"
            )
            self._thread.start()

    def __iter__(self) -> "PrefetchingBatches":
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        item = self._local_item() if self._thread is not None else None
        if self.tp_group is not None:
            item = self._broadcast(item)
        self.wait_seconds += time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise StopIteration
        return {key: value.to(self.device, non_blocking=True) for key, value in item.items()}

    def _local_item(self):
        """The next batch, None at the end, or the reader's exception (raised by __next__, after the
        TP group has heard of it, so no rank is left waiting in a broadcast)."""
        item = self._queue.get()
        return None if item is _END else item

    def _broadcast(self, item):
        """TP rank 0's batch (or its end, or its failure) on every rank of the TP group. The status and
        the schema go over the host group (no device sync); the batch's tensors over the TP group, on the
        training device, so the same code serves NCCL (CUDA) and gloo (CPU)."""
        src = dist.get_global_rank(self.tp_group, 0)
        failed = isinstance(item, BaseException)
        self._status_host[0] = -1 if failed else int(item is not None)
        dist.broadcast(self._status, src=src, group=self.status_group)
        code = int(self._status_host[0])
        if code == -1:
            return item if failed else RuntimeError("TP rank 0's batch reader failed (its error is in its log)")
        if code == 0:
            return None
        if self._schema is None:  # shapes and dtypes, once: every later batch has the same
            schema = [[(k, v.shape, v.dtype) for k, v in item.items()] if item is not None else None]
            dist.broadcast_object_list(schema, src=src, group=self.status_group)
            self._schema = schema[0]
        if item is None:
            item = {key: torch.empty(shape, dtype=dtype, device=self.device) for key, shape, dtype in self._schema}
        else:
            item = {key: value.to(self.device, non_blocking=True) for key, value in item.items()}
        for key, _, _ in self._schema:
            dist.broadcast(item[key], src=src, group=self.tp_group)
        return item

    def close(self) -> None:
        """Stop the reading thread (an iterator that wraps round never ends by itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __del__(self) -> None:
        self._stop.set()


def batch_iterator(
    dataset,
    *,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
    wrap: bool = False,
    prefetch: int = 2,
) -> PrefetchingBatches:
    """Micro batches from `consumed_samples` on. With wrap=True the index runs round the dataset
    (validation, whose size Megatron sizes for every evaluation anyway)."""
    tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    reads = tp_group is None or ps.get_tensor_model_parallel_rank() == 0
    source = (
        _read_batches(
            dataset,
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            wrap=wrap,
            pin=device.type == "cuda",
        )
        if reads
        else None
    )
    return PrefetchingBatches(source, device, depth=prefetch, tp_group=tp_group)
