"""GPT-2 byte-level BPE (Megatron's GPT2BPETokenizer): vocab.json + merges.txt in, token ids out.

The ids are those of `transformers.GPT2TokenizerFast.from_pretrained(dir)` on the same files, with
one deliberate difference that Megatron-LM itself makes: a literal `<|endoftext|>` inside a
document is ordinary text (Megatron's GPT-2 BPE has no special-token splitting); only
`--append-eod` adds the EOD id.

Two engines give those ids; one is chosen at construction and logged:
- "tiktoken": tiktoken's Rust BPE with ranks built from merges.txt (several times faster), fed
  GPT-2's split through a lookahead-free pattern and a marker character (see _TiktokenEngine).
  Ranking merged tokens instead of merge pairs equals GPT-2's BPE for ordinary vocabularies, but
  not by construction, so "auto" first checks it against the exact engine on probe texts (every
  vocab entry on its own and with a leading space, plus mixed text) and uses it only if all agree.
  The verdict is cached per (vocab.json, merges.txt, engine revision, tiktoken version) under
  $XDG_CACHE_HOME/megatron_core/tokenizer (~/.cache/...; MEGATRON_CORE_TOKENIZER_CACHE=0 turns it
  off, any other value is the directory to use), so only the first run pays for the probe.
- "hf": the Hugging Face `tokenizers` BPE, the same engine GPT2TokenizerFast runs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from megatron_core.errors import UserError
from megatron_core.files import replace_atomically

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenizer regex (the one Megatron's GPT2Tokenizer and HF's ByteLevel use).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same without the lookahead (see _TiktokenEngine for how its pieces are made GPT-2's).
LOOKAHEAD_FREE_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"""
ENGINES = ("auto", "tiktoken", "hf")

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


def _read_bytes(path, what: str, example: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{what} file {path} does not exist; give the {example} of the tokenizer") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} file {path} ({exc}); it must be a GPT-2 {example}") from None


def _parse_vocab(raw: bytes, vocab_file) -> dict[str, int]:
    try:
        vocab = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read vocab file {vocab_file} ({exc}); it must be a GPT-2 vocab.json") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise UserError(f"vocab file {vocab_file} is not a JSON object of token -> id; it must be a GPT-2 vocab.json")
    return vocab


def _parse_merges(raw: bytes, merge_file) -> list[tuple[int, str, str]]:
    """(line number, left, right) for every merge line."""
    try:
        lines = raw.decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise UserError(f"cannot read merges file {merge_file} ({exc}); it must be a GPT-2 merges.txt") from None
    merges = []
    for number, line in enumerate(lines, start=1):
        left, space, right = line.partition(" ")
        if left and right and " " not in right and number > 1:
            merges.append((number, left, right))  # the common case, checked cheaply
            continue
        if (number == 1 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise UserError(f"{merge_file} line {number}: {line!r} is not a merge ('left right'); fix or regenerate the file")
        merges.append((number, parts[0], parts[1]))
    return merges


def _read_vocab(vocab_file) -> dict[str, int]:
    return _parse_vocab(_read_bytes(vocab_file, "vocab", "vocab.json"), vocab_file)


def _read_merges(merge_file) -> list[tuple[int, str, str]]:
    return _parse_merges(_read_bytes(merge_file, "merges", "merges.txt"), merge_file)


def check_tokenizer_files(vocab_file, merge_file) -> None:
    """Refuse files that cannot be a GPT-2 BPE pair: every merge's parts and result must be in
    the vocab, every byte must be in the vocab, and `<|endoftext|>` must be present."""
    _check_tokenizer(_read_vocab(vocab_file), _read_merges(merge_file), vocab_file, merge_file)


def _check_tokenizer(vocab: dict, merges: list, vocab_file, merge_file) -> None:
    u2b = _unicode_to_bytes()
    stray = set("".join(t for t in vocab if t != EOD_TOKEN)).difference(u2b)
    if stray:
        bad = next(t for t in vocab if t != EOD_TOKEN and not stray.isdisjoint(t))
        raise UserError(
            f"{vocab_file}: entry {bad!r} is not in GPT-2's byte-level alphabet; "
            "the files must be a byte-level BPE (GPT-2 format)"
        )
    _, lefts, rights = zip(*merges) if merges else ((), (), ())
    tokens = vocab.keys()
    if not (tokens >= set(lefts) and tokens >= set(rights) and tokens >= set(map(str.__add__, lefts, rights))):
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

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)


class _TiktokenEngine:
    """tiktoken's Rust BPE on ranks built from merges.txt, splitting text as GPT-2 does.

    GPT-2's split pattern ends in `\\s+(?!\\S)|\\s+`; that lookahead sends tiktoken to its slow
    backtracking regex VM, which halves its speed. The pattern without it, `\\s+`, splits a text
    differently only at a whitespace run W of two or more characters followed by a non-whitespace
    character: GPT-2 makes W[:-1] one piece and lets W[-1] start the next one, the lookahead-free
    pattern takes all of W. So the engine inserts a marker character Z between W[:-1] and W[-1]
    (a control byte that is neither whitespace, letter nor number, that no merge of this vocab
    contains and that the text does not hold), splits with the lookahead-free pattern, and drops
    Z's id from the result. Z then is a piece of its own (" Z" when W[:-1] is one space, which BPE
    leaves as [" ", Z]) and every other piece is GPT-2's. A text that holds Z, or a vocab that
    merges every candidate, is encoded with GPT-2's pattern itself.
    """

    name = "tiktoken"

    def __init__(self, vocab: dict, merges: list[tuple[int, str, str]]) -> None:
        # tiktoken's ranks order its merges; when vocab ids grow with the merge order (true of
        # GPT-2's files and of what `train_bpe_tokenizer` writes) the ids are the ranks, else a
        # table maps rank -> id. The bytes' ranks are never compared, only returned.
        results = [left + right for _, left, right in merges]
        ids = [vocab[token] for token in results]
        monotonic = all(map(int.__lt__, ids, ids[1:]))
        ranks: dict[bytes, int] = {}
        rank_to_id = []
        for b, char in bytes_to_unicode().items():
            ranks[bytes((b,))] = vocab[char] if monotonic else len(rank_to_id)
            rank_to_id.append(vocab[char])
        # Every vocab character stands for one byte: translate all results at once, then cut.
        blob = "".join(results).translate(_to_bytes_table()).encode("latin-1")
        ends = list(itertools.accumulate(map(len, results)))
        for start, end, merged_id, token in zip([0, *ends], ends, ids, results):
            merged = blob[start:end]
            if merged in ranks:
                # Two merges making one token cannot be expressed as token ranks.
                raise _EngineUnfit(f"merge result {token!r} is made by two merges")
            ranks[merged] = merged_id if monotonic else len(rank_to_id)
            rank_to_id.append(merged_id)
        if len(set(ranks.values())) != len(ranks):
            raise _EngineUnfit("vocab.json gives one id to several tokens")
        self._setup(ranks, None if monotonic else np.asarray(rank_to_id, dtype=np.uint32), _free_marker(results))

    def _setup(self, ranks: dict[bytes, int], rank_to_id: Optional[np.ndarray], marker: Optional[str]) -> None:
        import tiktoken

        self._ranks, self._rank_to_id, self.marker = ranks, rank_to_id, marker
        # One special token that is never allowed (a literal <|endoftext|> stays text): with none,
        # tiktoken's encode path scans for an empty pattern at every position and is slower.
        self._specials = {EOD_TOKEN: max(ranks.values()) + 1}
        self._gpt2_encoding = None  # built when first needed
        if marker is not None:
            self._marker_rank = ranks[marker.encode()]
            self._marker_byte = ord(marker)
            self._marked = tiktoken.Encoding("megatron-gpt2-bpe-marked", pat_str=LOOKAHEAD_FREE_SPLIT_PATTERN,
                                              mergeable_ranks=ranks, special_tokens=self._specials)

    def save_tables(self, path: Path, files_sha256: str) -> None:
        """The ranks, the rank -> id table and the marker, for `load_tables` (numpy .npz), sealed with a
        digest of themselves and of the files they were built from."""
        tokens = list(self._ranks)
        arrays = {
            "blob": np.frombuffer(b"".join(tokens), dtype=np.uint8),
            "ends": np.fromiter(itertools.accumulate(map(len, tokens)), dtype=np.int64, count=len(tokens)),
            "ranks": np.fromiter(self._ranks.values(), dtype=np.int64, count=len(tokens)),
            "rank_to_id": self._rank_to_id if self._rank_to_id is not None else np.zeros(0, dtype=np.uint32),
            "marker": np.int64(-1 if self.marker is None else ord(self.marker)),
        }
        with open(path, "wb") as f:
            np.savez(f, digest=np.array(_tables_digest(arrays, files_sha256)), **arrays)

    @classmethod
    def load_tables(cls, path: Path, files_sha256: str) -> Optional["_TiktokenEngine"]:
        """The engine saved by `save_tables` for these files, or None when the digest does not match
        (tables of other files, or damaged ones that still load). Checking the digest costs ~1 ms where
        re-deriving every token's id from the vocab cost 50-90 ms of each start."""
        with np.load(path) as tables:
            arrays = {key: tables[key] for key in ("blob", "ends", "ranks", "rank_to_id", "marker")}
            if str(tables["digest"]) != _tables_digest(arrays, files_sha256):
                return None
        blob, ends = arrays["blob"].tobytes(), arrays["ends"].tolist()
        ranks = dict(zip([blob[a:b] for a, b in zip([0, *ends], ends)], arrays["ranks"].tolist()))
        marker = int(arrays["marker"])
        engine = cls.__new__(cls)
        engine._setup(ranks, arrays["rank_to_id"] if arrays["rank_to_id"].size else None,
                      None if marker < 0 else chr(marker))
        return engine

    @property
    def _gpt2(self):
        """tiktoken with GPT-2's own pattern: for texts that hold the marker, or no marker."""
        if self._gpt2_encoding is None:
            import tiktoken

            self._gpt2_encoding = tiktoken.Encoding(
                "megatron-gpt2-bpe", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=self._ranks, special_tokens=self._specials
            )
        return self._gpt2_encoding

    def encode_array(self, text: str) -> np.ndarray:
        """The ids of text as a uint32 array."""
        z = self.marker
        try:
            if z is None or z in text:
                ranks = self._gpt2.encode_to_numpy(text, disallowed_special=())
            else:
                marked = _mark_ascii(text, self._marker_byte) if text.isascii() else _MARK_AT.sub(z, text)
                ranks = self._marked.encode_to_numpy(marked, disallowed_special=())
                ranks = ranks[ranks != self._marker_rank]
        except UnicodeEncodeError:
            # Lone surrogates (JSON may hold them): encoded as U+FFFD, as tiktoken's encode does.
            return self.encode_array(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))
        return ranks if self._rank_to_id is None else self._rank_to_id[ranks]

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_gpt2_pattern(self, text: str) -> np.ndarray:
        """The ids from the same ranks split by GPT-2's own pattern (lookahead included), without the
        marker: what encode_array must give, for checks (the bench, the tests)."""
        ranks = self._gpt2.encode_to_numpy(text, disallowed_special=())
        return ranks if self._rank_to_id is None else self._rank_to_id[ranks]


# Unicode White_Space, what \s means to tiktoken's Rust regex and to the HF tokenizers' (Python's
# `\s` and str.isspace differ: they also take \x1c-\x1f).
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# Between the last two characters of a whitespace run that a non-whitespace character follows.
_MARK_AT = re.compile(f"(?<=[{_WHITE_SPACE}])(?=[{_WHITE_SPACE}][^{_WHITE_SPACE}])")
# Marker candidates: control bytes, not White_Space, not \p{L} nor \p{N}; one UTF-8 byte each.
_MARKER_CANDIDATES = [chr(c) for c in (*range(0x00, 0x09), *range(0x0E, 0x20), 0x7F)]


def _mark_ascii(text: str, marker: int) -> str:
    """_MARK_AT.sub(chr(marker), text) for ASCII text, with numpy (several times faster)."""
    chars = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    space = (chars == 32) | ((chars - np.uint8(9)) < 5)  # [ \t\n\v\f\r]: wraps below 9
    edge = space[:-2] & space[1:-1]
    edge &= ~space[2:]
    at = np.flatnonzero(edge)
    if not at.size:
        return text
    at += np.arange(1, at.size + 1)  # the markers' places in the output
    out = np.full(chars.size + at.size, marker, dtype=np.uint8)
    keep = np.ones(out.size, dtype=bool)
    keep[at] = False
    out[keep] = chars
    return out.tobytes().decode("ascii")


def _free_marker(results: list[str]) -> Optional[str]:
    """The first candidate marker whose byte no merge result contains (so BPE never joins it)."""
    merged = set("".join(results))
    b2u = bytes_to_unicode()
    return next((c for c in _MARKER_CANDIDATES if b2u[ord(c)] not in merged), None)


@lru_cache(maxsize=1)
def _to_bytes_table() -> dict[int, int]:
    """str.translate table from vocab.json's characters to the code points of their bytes."""
    return {ord(c): b for b, c in bytes_to_unicode().items()}


class _EngineUnfit(Exception):
    pass


# Bump when _probe_texts changes: cached verdicts of the old probe are then not trusted.
_PROBE_REVISION = "probe-1: each token alone, after a space and doubled; the mixed passage"


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
# The probe's verdict, cached
# ----------------------------------------------------------------------------------------------

# "0" (or off/no/false) turns the cache off; any other value is the directory to use instead of
# $XDG_CACHE_HOME/megatron_core/tokenizer (~/.cache/megatron_core/tokenizer).
TOKENIZER_CACHE_ENV = "MEGATRON_CORE_TOKENIZER_CACHE"
# Part of the cache key: change it whenever _TiktokenEngine encodes differently, so that a verdict
# about the old engine is never taken for the new one.
_ENGINE_REVISION = "tiktoken-engine-2 (lookahead-free split with a marker)"


def tokenizer_cache_dir() -> Optional[Path]:
    setting = os.environ.get(TOKENIZER_CACHE_ENV, "")
    if setting.lower() in ("0", "off", "no", "false"):
        return None
    if setting:
        return Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_core" / "tokenizer"


def _verdict_path(files_sha256: str) -> Optional[Path]:
    """Where the verdict for these files, this engine and this tiktoken lives (None: no cache)."""
    import tiktoken

    directory = tokenizer_cache_dir()
    if directory is None:
        return None
    # Everything the verdict depends on: the files, our engine, tiktoken, the exact BPE it was
    # compared with (HF tokenizers) and the probe itself.
    key = hashlib.sha256(f"{files_sha256}\0{_ENGINE_REVISION}\0tiktoken {tiktoken.__version__}\0tokenizers "
                         f"{_hf_tokenizers_version()}\0{_PROBE_REVISION}\0{_PROBE_TEXT}".encode()).hexdigest()
    return directory / f"verdict-{key[:32]}.json"


def _trusted(path: Path) -> bool:
    """A cache file this user wrote and nobody else can change (a shared, writable cache directory
    must not let another user plant a verdict or tables)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022


@lru_cache(maxsize=1)
def _hf_tokenizers_version() -> str:
    """HF tokenizers' installed version without importing it or importlib.metadata (either costs a
    cached start 20-50 ms): the name of its .dist-info beside the package."""
    import importlib.util

    spec = importlib.util.find_spec("tokenizers")
    if spec is None or not spec.origin:
        return "absent"
    package = Path(spec.origin).parent
    found = sorted(d.name for d in package.parent.glob("tokenizers-*.dist-info"))
    return found[-1] if found else f"unknown, {package.stat().st_mtime_ns}"


def _read_verdict(path: Optional[Path]) -> Optional[dict]:
    if path is None or not _trusted(path):
        return None
    try:
        verdict = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or damaged: probe again
    if not (isinstance(verdict, dict) and isinstance(verdict.get("equal"), bool) and isinstance(verdict.get("why"), str)):
        return None
    return verdict


def _tables_digest(arrays: dict, files_sha256: str) -> str:
    """sha256 of the files' digest and of every table's dtype, shape and bytes, in a fixed order."""
    digest = hashlib.sha256(files_sha256.encode())
    for key in sorted(arrays):
        value = np.ascontiguousarray(arrays[key])
        digest.update(f"{key}:{value.dtype.str}:{value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _write_cache(path: Optional[Path], write) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, write)
    except OSError as exc:  # a read-only or full cache only costs the probe next time: say so
        _log(f"tokenizer cache: cannot write {path} ({exc.strerror or exc}); the check runs again next time "
             f"(set {TOKENIZER_CACHE_ENV} to a writable directory, or 0 to turn the cache off)")


# ----------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------


class GPT2BPETokenizer:
    """Megatron's GPT2BPETokenizer on GPT-2-format files."""

    def __init__(self, vocab_file, merge_file, engine: str = "auto", quiet: bool = False) -> None:
        if engine not in ENGINES:
            raise UserError(f"unknown tokenizer engine {engine!r}; use one of {', '.join(ENGINES)}")
        vocab_raw = _read_bytes(vocab_file, "vocab", "vocab.json")
        merges_raw = _read_bytes(merge_file, "merges", "merges.txt")
        self.vocab: dict[str, int] = _parse_vocab(vocab_raw, vocab_file)
        self.vocab_file, self.merge_file = os.fspath(vocab_file), os.fspath(merge_file)
        self._inverse: Optional[dict[int, str]] = None  # built by the first decode
        files_sha256 = hashlib.sha256(b"vocab.json\0%s\0merges.txt\0%s" % (vocab_raw, merges_raw)).hexdigest()
        self.engine, why = self._cached_engine(engine, files_sha256)
        if self.engine is None:  # no verdict cached yet: read, check and probe
            merges = _parse_merges(merges_raw, merge_file)
            _check_tokenizer(self.vocab, merges, vocab_file, merge_file)
            self.engine, why = self._choose_engine(engine, merges, files_sha256)
        self.eod: int = self.vocab[EOD_TOKEN]
        if not quiet:
            _log(f"GPT2BPETokenizer: vocab {self.vocab_size}, engine {self.engine.name} ({why})")

    def _cached_engine(self, requested: str, files_sha256: str):
        """The tiktoken engine from the cache, when a verdict says it equals the exact BPE on
        these very files (which were checked before that verdict was written)."""
        cache = _verdict_path(files_sha256) if requested == "auto" else None
        verdict = _read_verdict(cache)
        if verdict is None or not verdict["equal"]:
            return None, None
        tables = cache.with_suffix(".npz")
        try:
            engine = _TiktokenEngine.load_tables(tables, files_sha256) if _trusted(tables) else None
        except Exception:  # noqa: BLE001 - truncated or damaged in any way: build them again
            engine = None
        if engine is None:
            if tables.exists():
                _log(f"tokenizer cache: {tables} is damaged, not this vocab's or writable by others; rebuilding it")
            return None, None
        return engine, f"{verdict['why']} (cached in {cache})"

    def _choose_engine(self, requested: str, merges, files_sha256: str):
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
        cache = _verdict_path(files_sha256)
        verdict = _read_verdict(cache)
        if verdict is None or verdict["equal"]:  # (equal: the tables were missing)
            verdict = self._probe(fast, _HFEngine(self.vocab, merges)) if verdict is None else verdict
            if verdict["equal"] and cache is not None:
                _write_cache(cache.with_suffix(".npz"), lambda path: fast.save_tables(path, files_sha256))
            _write_cache(cache, lambda path: path.write_text(json.dumps(verdict), encoding="utf-8"))
        else:
            verdict["why"] += f" (cached in {cache})"
        if verdict["equal"]:
            return fast, verdict["why"]
        return _HFEngine(self.vocab, merges), verdict["why"]

    def _probe(self, fast: "_TiktokenEngine", exact: _HFEngine) -> dict:
        probes = _probe_texts(self.vocab)
        for text, expected in zip(probes, exact.encode_batch(probes)):
            if fast.encode(text) != expected:
                return {"equal": False, "why": f"tiktoken differs on probe {text[:40]!r}"}
        return {"equal": True, "why": f"verified equal to the exact BPE on {len(probes)} probe texts"}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.engine.encode_batch(texts)

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) as a uint32 numpy array (cheaper than the list for long texts)."""
        return self.engine.encode_array(text)

    def decode(self, ids: Iterable[int]) -> str:
        if self._inverse is None:
            self._inverse = {i: t for t, i in self.vocab.items()}
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
    replace_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
