"""Perplexity over a GPT dataset: token-weighted mean cross entropy, exp of it.

The loss is taken where the logits are (the evaluation device), in fp32 from whatever precision the
model runs in, and summed in float64."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm


@torch.no_grad()
def evaluate_perplexity(
    model_fn: Callable[[torch.Tensor], torch.Tensor],
    dataset,
    batch_size: int = 8,
    max_batches: Optional[int] = None,
    desc: str = "perplexity",
) -> dict:
    """`dataset` items are dicts with `tokens`, `labels` and optionally `loss_mask` (GPTDataset);
    `model_fn(tokens [b, s] on the CPU) -> logits [b, s, V]` on any device. Loss is summed in float64
    over unmasked tokens, so batch size does not change the result."""
    n = len(dataset)
    num_batches = math.ceil(n / batch_size)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    total, count = 0.0, 0
    for b in tqdm(range(num_batches), desc=desc, unit="batch", mininterval=2.0):
        items = [dataset[i] for i in range(b * batch_size, min(n, (b + 1) * batch_size))]
        tokens = torch.stack([torch.as_tensor(x["tokens"]) for x in items]).long()
        labels = torch.stack([torch.as_tensor(x["labels"]) for x in items]).long()
        mask = (
            torch.stack([torch.as_tensor(x["loss_mask"]) for x in items]).double()
            if "loss_mask" in items[0]
            else torch.ones(labels.shape, dtype=torch.float64)
        )
        logits = model_fn(tokens).float()
        labels, mask = labels.to(logits.device), mask.to(logits.device)
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        total += (losses.double() * mask.reshape(-1)).sum().item()
        count += int(mask.sum().item())
    if count == 0:
        return {"loss": float("nan"), "ppl": float("nan"), "tokens": 0}
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": count}
