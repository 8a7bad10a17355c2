"""GPT-2 byte-level BPE (Megatron's GPT2BPETokenizer): vocab.json + merges.txt in, token ids out.

The ids are those of `transformers.GPT2TokenizerFast.from_pretrained(dir)` on the same files, with
one deliberate difference that Megatron-LM itself makes: a literal `<|endoftext|>` inside a
document is ordinary text (Megatron's GPT-2 BPE has no special-token splitting); only
`--append-eod` adds the EOD id.

Two engines give those ids; one is chosen at construction and logged:
- "tiktoken": tiktoken's Rust BPE with ranks built from merges.txt (several times faster). Ranking
  merged tokens instead of merge pairs equals GPT-2's BPE for ordinary vocabularies, but not by
  construction, so "auto" first checks it against the exact engine on probe texts (every vocab
  entry on its own and with a leading space, plus mixed text) and uses it only if all agree.
- "hf": the Hugging Face `tokenizers` BPE, the same engine GPT2TokenizerFast runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from megatron_core.errors import UserError

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenizer regex (the one Megatron's GPT2Tokenizer and HF's ByteLevel use).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENGINES = ("auto", "tiktoken", "hf")
# The same pattern for pure-ASCII text, where \p{L} is [A-Za-z], \p{N} is [0-9] and Unicode's
# White_Space is [\t\n\v\f\r ]: the stdlib `re` splits with it faster than tiktoken does.
_ASCII_SPLIT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""", re.ASCII)
_PIECE_CACHE_LIMIT = 1 << 20

_PROBE_TEXT = (
    "def f(x):\n    return x  # comment\n\n\n\tclass A(B):\n        pass\r\n"
    "Hello, World! It's 2024; they're 3.14 vs 1e-9 ... «ünïcödé» 日本語 🙂 \u00a0\u2003 x\n \n"
    "if a<b and c>=d: print('%s' % s, \"q\", `t`)\n    \n\n        \n"
)


def _log(message: str) -> None:
    print(f"[tokenizer] {message}", file=sys.stderr, flush=True)


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


# ----------------------------------------------------------------------------------------------
# Files: reading and checking
# ----------------------------------------------------------------------------------------------


def _read_vocab(vocab_file) -> dict[str, int]:
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except FileNotFoundError:
        raise UserError(f"vocab file {vocab_file} does not exist; give the vocab.json of the tokenizer") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read vocab file {vocab_file} ({exc}); it must be a GPT-2 vocab.json") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise UserError(f"vocab file {vocab_file} is not a JSON object of token -> id; it must be a GPT-2 vocab.json")
    return vocab


def _read_merges(merge_file) -> list[tuple[int, str, str]]:
    """(line number, left, right) for every merge line."""
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise UserError(f"merges file {merge_file} does not exist; give the merges.txt of the tokenizer") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read merges file {merge_file} ({exc}); it must be a GPT-2 merges.txt") from None
    merges = []
    for number, line in enumerate(lines, start=1):
        if (number == 1 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise UserError(f"{merge_file} line {number}: {line!r} is not a merge ('left right'); fix or regenerate the file")
        merges.append((number, parts[0], parts[1]))
    return merges


def check_tokenizer_files(vocab_file, merge_file) -> None:
    """Refuse files that cannot be a GPT-2 BPE pair: every merge's parts and result must be in
    the vocab, every byte must be in the vocab, and `<|endoftext|>` must be present."""
    vocab = _read_vocab(vocab_file)
    merges = _read_merges(merge_file)
    u2b = _unicode_to_bytes()
    bad_chars = [t for t in vocab if t != EOD_TOKEN and any(c not in u2b for c in t)]
    if bad_chars:
        raise UserError(
            f"{vocab_file}: entry {bad_chars[0]!r} is not in GPT-2's byte-level alphabet; "
            "the files must be a byte-level BPE (GPT-2 format)"
        )
    for number, left, right in merges:
        for piece in (left, right, left + right):
            if piece not in vocab:
                raise UserError(
                    f"{merge_file} line {number} ({left} {right}): {piece!r} is not in {vocab_file}; "
                    "vocab.json and merges.txt do not belong together, use the pair written by one training"
                )
    missing_bytes = [c for c in bytes_to_unicode().values() if c not in vocab]
    if missing_bytes:
        raise UserError(
            f"{vocab_file} lacks {len(missing_bytes)} of the 256 byte tokens (first {missing_bytes[0]!r}); "
            "a byte-level BPE needs all of them"
        )
    if EOD_TOKEN not in vocab:
        raise UserError(f"{vocab_file} has no {EOD_TOKEN} token; GPT-2 preprocessing needs it as the EOD id")


# ----------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------


class _HFEngine:
    name = "hf"

    def __init__(self, vocab: dict, merges: list[tuple[int, str, str]]) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self._tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges]))
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tokenizer.decoder = decoders.ByteLevel()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]


class _TiktokenEngine:
    name = "tiktoken"

    def __init__(self, vocab: dict, merges: list[tuple[int, str, str]]) -> None:
        import tiktoken

        # Rank = position in the merge list (bytes first); tiktoken's ranks are its ids, so keep
        # a table from rank to our vocab id.
        ranks: dict[bytes, int] = {}
        rank_to_id = []
        for b, char in bytes_to_unicode().items():
            ranks[bytes([b])] = len(rank_to_id)
            rank_to_id.append(vocab[char])
        for _, left, right in merges:
            merged = token_bytes(left + right)
            if merged in ranks:
                # Two merges making one token cannot be expressed as token ranks.
                raise _EngineUnfit(f"merge result {left + right!r} is made by two merges")
            ranks[merged] = len(rank_to_id)
            rank_to_id.append(vocab[left + right])
        self._encoding = tiktoken.Encoding(
            "megatron-gpt2-bpe", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={}
        )
        self._rank_to_id = np.asarray(rank_to_id, dtype=np.int64)
        self._rank_to_id_list = rank_to_id
        # Code repeats its pieces (identifiers, indentation): BPE each distinct piece once.
        self._piece_ids: dict[str, list[int]] = {}
        # tiktoken's one-piece BPE (no re-split); without it, encoding the piece alone is the same.
        self._bpe_piece = getattr(self._encoding, "_encode_single_piece", self._encoding.encode_ordinary)

    def encode(self, text: str) -> list[int]:
        if not text.isascii():
            return self._rank_to_id[self._encoding.encode_ordinary(text)].tolist()
        cache = self._piece_ids
        if len(cache) > _PIECE_CACHE_LIMIT:
            cache.clear()
        out: list[int] = []
        for piece in _ASCII_SPLIT.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = cache[piece] = [self._rank_to_id_list[r] for r in self._bpe_piece(piece)]
            out += ids
        return out

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class _EngineUnfit(Exception):
    pass


def _probe_texts(vocab: dict) -> list[str]:
    """Texts that put every vocab entry where the BPE must rebuild it: alone, after a space,
    and a mixed passage."""
    texts = [_PROBE_TEXT, _PROBE_TEXT * 3]
    for token in vocab:
        if token == EOD_TOKEN:
            continue
        raw = token_bytes(token).decode("utf-8", errors="replace")
        texts.append(raw)
        texts.append(" " + raw + raw)
    return texts


# ----------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------


class GPT2BPETokenizer:
    """Megatron's GPT2BPETokenizer on GPT-2-format files."""

    def __init__(self, vocab_file, merge_file, engine: str = "auto", quiet: bool = False) -> None:
        if engine not in ENGINES:
            raise UserError(f"unknown tokenizer engine {engine!r}; use one of {', '.join(ENGINES)}")
        check_tokenizer_files(vocab_file, merge_file)
        self.vocab_file, self.merge_file = os.fspath(vocab_file), os.fspath(merge_file)
        self.vocab: dict[str, int] = _read_vocab(vocab_file)
        merges = _read_merges(merge_file)
        self._inverse = {i: t for t, i in self.vocab.items()}
        self.eod: int = self.vocab[EOD_TOKEN]
        self.engine, why = self._choose_engine(engine, merges)
        if not quiet:
            _log(f"GPT2BPETokenizer: vocab {self.vocab_size}, engine {self.engine.name} ({why})")

    def _choose_engine(self, requested: str, merges):
        if requested == "hf":
            return _HFEngine(self.vocab, merges), "requested"
        try:
            fast = _TiktokenEngine(self.vocab, merges)
        except _EngineUnfit as exc:
            if requested == "tiktoken":
                raise UserError(f"tokenizer engine tiktoken cannot represent these files: {exc}; use engine hf") from None
            return _HFEngine(self.vocab, merges), f"tiktoken unfit: {exc}"
        if requested == "tiktoken":
            return fast, "requested"
        exact = _HFEngine(self.vocab, merges)
        probes = _probe_texts(self.vocab)
        for text, expected in zip(probes, exact.encode_batch(probes)):
            if fast.encode(text) != expected:
                return exact, f"tiktoken differs on probe {text[:40]!r}"
        return fast, f"verified equal to the exact BPE on {len(probes)} probe texts"

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.engine.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        raw = b"".join(token_bytes(self._inverse[int(i)]) if int(i) != self.eod else EOD_TOKEN.encode() for i in ids)
        return raw.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


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
    seen = {"n": 0}

    def counted():
        for text in texts:
            seen["n"] += 1
            yield text

    _log(f"training byte-level BPE: vocab_size {vocab_size}, min_frequency {min_frequency}")
    tokenizer.train_from_iterator(counted(), trainer)
    if seen["n"] == 0:
        raise UserError("no texts to train the tokenizer on; the corpus is empty")
    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_path, merges_path = out_dir / "vocab.json", out_dir / "merges.txt"
    _atomic_write(vocab_path, json.dumps(vocab, ensure_ascii=False))
    _atomic_write(merges_path, "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    _log(f"trained on {seen['n']} texts: {len(vocab)} tokens, {len(merges)} merges -> {out_dir}")
    return vocab_path, merges_path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
