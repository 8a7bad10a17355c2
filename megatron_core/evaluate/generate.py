"""Our decoder: greedy or temperature + top-p sampling, with stop sequences, for any logits function.

`model_fn(input_ids [b, s]) -> logits [b, s, V]` (our MegatronCausalLM, or `lambda x: hf(x).logits`).
No KV cache: each step runs the whole (window-truncated) context. Enough for evaluation of small
models on a CPU; the HF path can use `hf.generate` where speed matters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

HUMANEVAL_STOP = ("\ndef", "\nclass", "\nif", "\nprint", "\n#")


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop_sequences: Sequence[str] = field(default_factory=tuple)
    eos_token_id: Optional[int] = None
    vocab_limit: Optional[int] = None  # mask padded vocab rows (ids >= limit) out of sampling
    context_window: Optional[int] = None  # keep only the last N tokens as input


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability sums to >= top_p (at least one)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def next_tokens(logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator]) -> torch.Tensor:
    logits = logits.float()
    if cfg.vocab_limit is not None:
        logits[:, cfg.vocab_limit:] = float("-inf")
    if cfg.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = top_p_filter(logits / cfg.temperature, cfg.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def truncate_at_stop(text: str, stop_sequences: Sequence[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop_sequences) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@torch.no_grad()
def generate(model_fn: Callable[[torch.Tensor], torch.Tensor], prompt_ids: Sequence[int], cfg: SamplingConfig,
             num_samples: int = 1, decode: Optional[Callable[[list], str]] = None,
             generator: Optional[torch.Generator] = None) -> list[list[int]]:
    """`num_samples` continuations of one prompt (batched), each cut at EOS; with `decode` and stop
    sequences, a sample stops growing once its decoded text holds a stop sequence (the caller cuts
    the text with truncate_at_stop)."""
    ids = torch.tensor([list(prompt_ids)] * num_samples, dtype=torch.long)
    new: list[list[int]] = [[] for _ in range(num_samples)]
    done = [False] * num_samples
    for _ in range(cfg.max_new_tokens):
        context = ids if cfg.context_window is None else ids[:, -cfg.context_window:]
        token = next_tokens(model_fn(context)[:, -1, :], cfg, generator)
        ids = torch.cat([ids, token[:, None]], dim=1)
        for i, t in enumerate(token.tolist()):
            if done[i]:
                continue
            if cfg.eos_token_id is not None and t == cfg.eos_token_id:
                done[i] = True
                continue
            new[i].append(t)
            if decode is not None and cfg.stop_sequences and truncate_at_stop(decode(new[i]), cfg.stop_sequences)[1]:
                done[i] = True
        if all(done):
            break
    return new
