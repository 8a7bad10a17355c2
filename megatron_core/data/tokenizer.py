"""GPT-2 byte-level BPE (Megatron's GPT2BPETokenizer): vocab.json + merges.txt in, token ids out.

The ids are those of `transformers.GPT2TokenizerFast.from_pretrained(dir)` on the same files, with
one deliberate difference that Megatron-LM itself makes: a literal `<|endoftext|>` inside a
document is ordinary text (Megatron's GPT-2 BPE has no special-token splitting); only
`--append-eod` adds the EOD id.

Two engines give those ids, one chosen at construction and logged: "tiktoken" (its Rust BPE with GPT-2's
split pattern, as nanoGPT uses, ranks = vocab ids: exact on files shaped as BPE training writes them, which
_tiktoken_ranks checks) and "hf" (the `tokenizers` BPE that GPT2TokenizerFast runs), which "auto" takes,
saying why, for files whose merges tiktoken's ranks cannot express.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np

from megatron_core.errors import UserError
from megatron_core.files import replace_atomically
from megatron_core.log import get_logger

_LOG = get_logger(__name__, tag="tokenizer", stderr=True)

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenizer regex (the one Megatron's GPT2Tokenizer and HF's ByteLevel use).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENGINES = ("auto", "tiktoken", "hf")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters used in vocab.json."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    """The raw bytes a vocab.json entry stands for."""
    u2b = _unicode_to_bytes()
    return bytes(u2b[c] for c in token)


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Files: reading and checking


def _read_text(path, what: str, example: str) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{what} file {path} does not exist; give the {example} of the tokenizer") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {what} file {path} ({exc}); it must be a GPT-2 {example}") from None


def _read_vocab(vocab_file) -> dict[str, int]:
    try:
        vocab = json.loads(_read_text(vocab_file, "vocab", "vocab.json"))
    except json.JSONDecodeError as exc:
        raise UserError(f"cannot read vocab file {vocab_file} ({exc}); it must be a GPT-2 vocab.json") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise UserError(f"vocab file {vocab_file} is not a JSON object of token -> id; it must be a GPT-2 vocab.json")
    return vocab


def _read_merges(merge_file) -> list[tuple[int, str, str]]:
    """(line number, left, right) for every merge line."""
    merges = []
    for number, line in enumerate(_read_text(merge_file, "merges", "merges.txt").split("\n"), start=1):
        if (number == 1 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise UserError(
                f"{merge_file} line {number}: {line!r} is not a merge ('left right'); fix or regenerate the file"
            )
        merges.append((number, parts[0], parts[1]))
    return merges


def check_tokenizer_files(vocab_file, merge_file) -> None:
    """Refuse files that cannot be a GPT-2 BPE pair: every merge's parts and result must be in
    the vocab, every byte must be in the vocab, and `<|endoftext|>` must be present."""
    _check_tokenizer(_read_vocab(vocab_file), _read_merges(merge_file), vocab_file, merge_file)


def _check_tokenizer(vocab: dict, merges: list, vocab_file, merge_file) -> None:
    u2b = _unicode_to_bytes()
    bad = next((t for t in vocab if t != EOD_TOKEN and not u2b.keys() >= set(t)), None)
    if bad is not None:
        raise UserError(
            f"{vocab_file}: entry {bad!r} is not in GPT-2's byte-level alphabet; "
            "the files must be a byte-level BPE (GPT-2 format)"
        )
    for number, left, right in merges:
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise UserError(
                    f"{merge_file} line {number} ({left} {right}): {piece!r} is not in {vocab_file}; "
                    "vocab.json and merges.txt do not belong together, use the pair one training wrote"
                )
    missing_bytes = [c for c in u2b if c not in vocab]
    if missing_bytes:
        raise UserError(
            f"{vocab_file} lacks {len(missing_bytes)} of the 256 byte tokens (first {missing_bytes[0]!r}); "
            "a byte-level BPE needs all of them"
        )
    if EOD_TOKEN not in vocab:
        raise UserError(f"{vocab_file} has no {EOD_TOKEN} token; GPT-2 preprocessing needs it as the EOD id")


# Engines


class _HFEngine:
    name = "hf"

    def __init__(self, vocab: dict, merges: list[tuple[int, str, str]]) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        self._tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges]))
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)


class _EngineUnfit(Exception):
    pass


def _tiktoken_ranks(vocab: dict[str, int], merges: list[tuple[int, str, str]]) -> dict[bytes, int]:
    """tiktoken's ranks for these files (the vocab ids), or _EngineUnfit saying why they would not give
    GPT-2's BPE. tiktoken joins the adjacent pair whose concatenation has the lowest rank, GPT-2 the pair
    earliest in merges.txt; with ranks = ids they agree on what BPE training writes: every multi-byte token
    made by exactly one merge, ids growing in merge order, each merge's parts made before it
    (docs/data-format.md). tiktoken's own data_gym_to_mergeable_bpe_ranks fixes the bytes at ids 0-255."""
    results = [left + right for _, left, right in merges]
    ids = [vocab[token] for token in results]
    if len(set(results)) != len(results):
        raise _EngineUnfit(f"merge result {Counter(results).most_common(1)[0][0]!r} is made by two merges")
    multi_byte = sum(1 for token in vocab if len(token) > 1) - (EOD_TOKEN in vocab)
    if multi_byte != len(results):
        raise _EngineUnfit(f"{multi_byte - len(results)} multi-byte tokens of vocab.json are made by no merge")
    if len(set(vocab.values())) != len(vocab):
        raise _EngineUnfit("vocab.json gives one id to several tokens")
    for (number, left, right), result_id, previous in zip(merges, ids, [-1, *ids]):
        if result_id <= previous or vocab[left] >= result_id or vocab[right] >= result_id:
            raise _EngineUnfit(f"merges.txt line {number} ({left} {right}) is out of the vocab ids' order")
    return {token_bytes(token): i for token, i in vocab.items() if token != EOD_TOKEN}


class _TiktokenEngine:
    name = "tiktoken"

    def __init__(self, vocab: dict[str, int], merges: list[tuple[int, str, str]]) -> None:
        import tiktoken

        # EOD is a special token that is never allowed (a literal <|endoftext|> stays text); with no
        # special token at all tiktoken's encode scans for an empty pattern and is slower.
        self._encoding = tiktoken.Encoding(
            "megatron-gpt2-bpe",
            pat_str=GPT2_SPLIT_PATTERN,
            mergeable_ranks=_tiktoken_ranks(vocab, merges),
            special_tokens={EOD_TOKEN: vocab[EOD_TOKEN]},
        )

    def encode_array(self, text: str) -> np.ndarray:
        try:
            return self._encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:
            # Lone surrogates (JSON may hold them): encoded as U+FFFD, as tiktoken's encode does.
            return self.encode_array(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()


# The tokenizer


class GPT2BPETokenizer:
    """Megatron's GPT2BPETokenizer on GPT-2-format files."""

    def __init__(self, vocab_file, merge_file, engine: str = "auto", quiet: bool = False) -> None:
        if engine not in ENGINES:
            raise UserError(f"unknown tokenizer engine {engine!r}; use one of {', '.join(ENGINES)}")
        self.vocab: dict[str, int] = _read_vocab(vocab_file)
        self.vocab_file, self.merge_file = os.fspath(vocab_file), os.fspath(merge_file)
        merges = _read_merges(merge_file)
        _check_tokenizer(self.vocab, merges, vocab_file, merge_file)
        self._inverse: dict[int, str] | None = None  # built by the first decode
        self.engine: _TiktokenEngine | _HFEngine
        try:
            self.engine = _HFEngine(self.vocab, merges) if engine == "hf" else _TiktokenEngine(self.vocab, merges)
            why = "requested" if engine != "auto" else "its ranks are the ids, merges in their order"
        except _EngineUnfit as exc:
            if engine == "tiktoken":
                raise UserError(
                    f"tokenizer engine tiktoken cannot represent these files: {exc}; use engine hf"
                ) from None
            self.engine, why = _HFEngine(self.vocab, merges), f"tiktoken cannot represent these files: {exc}"
        self.eod: int = self.vocab[EOD_TOKEN]
        if not quiet:
            _LOG.info(f"GPT2BPETokenizer: vocab {self.vocab_size}, engine {self.engine.name} ({why})")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) as a uint32 numpy array (cheaper than the list for long texts)."""
        return self.engine.encode_array(text)

    def decode(self, ids: Iterable[int]) -> str:
        if self._inverse is None:
            self._inverse = {i: t for t, i in self.vocab.items()}
        raw = b"".join(token_bytes(self._inverse[int(i)]) if int(i) != self.eod else EOD_TOKEN.encode() for i in ids)
        return raw.decode("utf-8", errors="replace")


# Training


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir, min_frequency: int = 2) -> tuple[Path, Path]:
    """Train a GPT-2-style byte-level BPE (`<|endoftext|>` = id 0, then the 256 bytes) and write
    vocab.json + merges.txt into out_dir, each under a temporary name first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise UserError(f"tokenizer vocab_size {vocab_size} is too small; a byte-level BPE needs at least 257")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = 0

    def counted():
        nonlocal seen
        for text in texts:
            seen += 1
            yield text

    _LOG.info(f"training byte-level BPE: vocab_size {vocab_size}, min_frequency {min_frequency}")
    tokenizer.train_from_iterator(counted(), trainer)
    if seen == 0:
        raise UserError("no texts to train the tokenizer on; the corpus is empty")
    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_path, merges_path = out_dir / "vocab.json", out_dir / "merges.txt"
    vocab_text = json.dumps(vocab, ensure_ascii=False)
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    replace_atomically(vocab_path, lambda tmp: tmp.write_text(vocab_text, encoding="utf-8"))
    replace_atomically(merges_path, lambda tmp: tmp.write_text(merges_text, encoding="utf-8"))
    _LOG.info(f"trained on {seen} texts: {len(vocab)} tokens, {len(merges)} merges -> {out_dir}")
    return vocab_path, merges_path
