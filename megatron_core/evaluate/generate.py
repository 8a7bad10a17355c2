"""Our decoders: greedy or temperature + top-p sampling, with stop sequences and EOS.

`generate_cached` is the one evaluation uses: a transformers causal LM (GPT2LMHeadModel) with its
KV cache, several prompts and many samples per prompt in one batch (left-padded), each prompt's
context computed once and shared by its samples, finished samples dropped from the batch.
`generate` recomputes the whole context for every new token through any logits function
(`model_fn(input_ids [b, s]) -> logits [b, s, V]`): the slow reference the cached decoder is
tested against, and the way to sample our own GPTModel directly.

Sampling draws from explicit uniforms (inverse CDF): sample i's t-th token uses uniforms[i, t].
A caller that seeds those per problem gets the same samples however the rows are batched.
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


def sample_tokens(logits: torch.Tensor, cfg: SamplingConfig, uniforms: Optional[torch.Tensor]) -> torch.Tensor:
    """logits [b, V] -> token ids [b]: argmax when greedy; else, over the tokens sorted by probability
    (temperature-scaled), the nucleus is the smallest prefix whose mass reaches top_p (at least one
    token), and the token is the nucleus's inverse CDF at `uniforms` [b] (values in [0, 1)). All in
    the sorted order: one sort, one softmax, one cumulative sum per step, no scatter back."""
    logits = logits.float()
    if cfg.vocab_limit is not None:
        logits[:, cfg.vocab_limit :] = float("-inf")
    if cfg.temperature <= 0:
        return logits.argmax(dim=-1)
    sorted_logits, order = (logits / cfg.temperature).sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1).double()
    cdf = probs.cumsum(dim=-1)
    # a token is in the nucleus when the mass before it is still short of top_p; never one of probability 0
    size = ((cdf - probs < cfg.top_p) & (probs > 0)).sum(dim=-1, keepdim=True).clamp_(min=1)
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf.gather(-1, size - 1)
    index = torch.minimum(torch.searchsorted(cdf, target, right=True), size - 1)
    return order.gather(-1, index).squeeze(-1)


def truncate_at_stop(text: str, stop_sequences: Sequence[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop_sequences) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class _Samples:
    """The growing samples of a batch: new tokens per row, which rows are still going (EOS, stops)."""

    def __init__(self, rows: int, cfg: SamplingConfig, decode: Optional[Callable[[list], str]]) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.cfg, self.decode = cfg, decode

    def add(self, rows: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Append each row's token; returns the positions (in `rows`) of the rows that go on."""
        going = []
        for position, (row, t) in enumerate(zip(rows, tokens)):
            if self.cfg.eos_token_id is not None and t == self.cfg.eos_token_id:
                continue
            self.tokens[row].append(t)
            if (
                self.decode is not None
                and self.cfg.stop_sequences
                and truncate_at_stop(self.decode(self.tokens[row]), self.cfg.stop_sequences)[1]
            ):
                continue
            going.append(position)
        return going


def _uniforms(uniforms: Optional[torch.Tensor], rows: int, cfg: SamplingConfig) -> Optional[torch.Tensor]:
    if cfg.temperature <= 0:
        return None
    if uniforms is None:
        return torch.rand((rows, cfg.max_new_tokens), dtype=torch.float64)
    if tuple(uniforms.shape) != (rows, cfg.max_new_tokens):
        raise ValueError(f"uniforms must be [{rows}, {cfg.max_new_tokens}], got {list(uniforms.shape)}")
    return uniforms


@torch.no_grad()
def generate(
    model_fn: Callable[[torch.Tensor], torch.Tensor],
    prompt_ids: Sequence[int],
    cfg: SamplingConfig,
    num_samples: int = 1,
    decode: Optional[Callable[[list], str]] = None,
    uniforms: Optional[torch.Tensor] = None,
) -> list[list[int]]:
    """`num_samples` continuations of one prompt by full recompute, each cut at EOS; with `decode` and
    stop sequences, a sample stops growing once its decoded text holds a stop sequence (the caller
    cuts the text with truncate_at_stop). `uniforms` [num_samples, max_new_tokens] drive sampling."""
    uniforms = _uniforms(uniforms, num_samples, cfg)
    ids = torch.tensor([list(prompt_ids)] * num_samples, dtype=torch.long)
    samples = _Samples(num_samples, cfg, decode)
    going = set(range(num_samples))
    for step in range(cfg.max_new_tokens):
        context = ids if cfg.context_window is None else ids[:, -cfg.context_window :]
        token = sample_tokens(model_fn(context)[:, -1, :], cfg, None if uniforms is None else uniforms[:, step])
        ids = torch.cat([ids, token[:, None]], dim=1)
        rows = sorted(going)
        going = {rows[i] for i in samples.add(rows, token[rows].tolist())}
        if not going:
            break
    return samples.tokens


@torch.no_grad()
def generate_cached(
    model,
    prompts: Sequence[Sequence[int]],
    counts: Sequence[int],
    cfg: SamplingConfig,
    decode: Optional[Callable[[list], str]] = None,
    uniforms: Optional[torch.Tensor] = None,
) -> list[list[int]]:
    """`counts[i]` samples of `prompts[i]` (token ids), in one batch through `model`'s KV cache.
    Rows come back prompt by prompt; `uniforms` [sum(counts), max_new_tokens] drive sampling.
    The caller keeps len(prompt) + max_new_tokens within the model's positions."""
    device = next(model.parameters()).device  # the embedding's; a spread model moves activations itself
    total = sum(counts)
    uniforms = _uniforms(uniforms, total, cfg)
    uniforms = None if uniforms is None else uniforms.to(device)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    # Row indices stay on the CPU: they index tensors on any GPU (a cache spread over several included).
    expand = torch.repeat_interleave(torch.arange(len(prompts)), torch.as_tensor(list(counts)))
    cache = out.cache
    cache.batch_select_indices(expand)  # each prompt's context once, shared by its samples
    logits, mask, position = out.logits[expand, -1], mask[expand], positions[expand, -1:] + 1
    samples = _Samples(total, cfg, decode)
    rows = torch.arange(total)
    for step in range(cfg.max_new_tokens):
        token = sample_tokens(logits, cfg, None if uniforms is None else uniforms[rows, step])
        going = samples.add(rows.tolist(), token.tolist())
        if not going or step == cfg.max_new_tokens - 1:
            break
        if len(going) < len(rows):  # finished samples leave the batch
            keep = torch.as_tensor(going)
            cache.batch_select_indices(keep)
            rows, token, mask, position = rows[keep], token[keep], mask[keep], position[keep]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, cache=cache, use_cache=True)
        cache, logits, position = out.cache, out.logits[:, -1], position + 1
    return samples.tokens
