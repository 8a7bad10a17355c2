"""Loose JSON lines -> Megatron `.bin/.idx`, as Megatron-LM's `tools/preprocess_data.py` does.

    python -m megatron_core.data.preprocess --input corpus.jsonl --json-keys content \\
        --output-prefix out/data --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 2

Writes `{prefix}_{key}_document.{bin,idx}` (`_sentence` with --split-sentences). Semantics of
Megatron-LM core_v0.8.0, byte for byte: one JSON line is one document; its text (or each
sentence) is tokenized, sentences with no tokens are dropped, and with --append-eod the EOD id
ends a document that has any token. A document with no tokens stays a document with zero
sequences. Input is streamed in chunks of lines to worker processes (results in input order).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import multiprocessing
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from megatron_core.data.indexed_dataset import IMPLS, IndexedDatasetBuilder, best_token_dtype
from megatron_core.data.tokenizer import ENGINES, GPT2BPETokenizer
from megatron_core.errors import UserError
from megatron_core.log import configure, get_logger

# By name, not __name__: under `python -m` this module is __main__, outside the package logger.
_LOG = get_logger("megatron_core.data.preprocess", stderr=True)

CHUNK_BYTES = 1 << 20  # small enough that the last chunks keep every worker busy to the end


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_core.data.preprocess", description=__doc__.split("\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="JSON-lines files or globs (.jsonl, .json, .gz)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--split-sentences", action="store_true", help="split documents into sentences (punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    g.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed JSON lines")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer"])
    g.add_argument("--vocab-file", required=True)
    g.add_argument("--merge-file", required=True)
    g.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    g.add_argument(
        "--lang", default="english", help="accepted for Megatron compatibility (punkt is trained on the input)"
    )
    g.add_argument("--tokenizer-engine", default="auto", choices=ENGINES)
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--dataset-impl", default="mmap", choices=IMPLS)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1)
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="accepted for Megatron compatibility: its partitions only split the work, the output is "
        "the same; here the --workers share one ordered stream",
    )
    g.add_argument("--log-interval", type=int, default=1000)
    return p


def preprocess_args(**options) -> argparse.Namespace:
    """The Namespace the CLI would build, from keyword arguments named like its flags."""
    args = build_parser().parse_args(["--input", "-", "--vocab-file", "-", "--merge-file", "-", "--output-prefix", "-"])
    for key, value in options.items():
        if not hasattr(args, key):
            raise TypeError(f"preprocess has no option {key!r}")
        setattr(args, key, value)
    return args


# ----------------------------------------------------------------------------------------------
# Input
# ----------------------------------------------------------------------------------------------


def expand_inputs(patterns) -> list[str]:
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"--input {pattern} matches no file; check the path or the glob")
        for path in matches:
            if not os.path.isfile(path):
                raise UserError(f"input file {path} does not exist; check --input")
            if not os.access(path, os.R_OK):
                raise UserError(f"input file {path} is not readable; check its permissions")
            files.append(path)
    return files


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


@dataclass
class _Chunk:
    path: str
    first_line: int
    data: bytes  # whole lines of the file (the last one without a newline at the end of a file)

    def lines(self) -> Iterator[tuple[int, bytes, int]]:
        """(line number, line, its size in the file) for each line that is not blank (blank lines
        are not documents: json.loads refuses them too)."""
        lines = self.data.split(b"\n")
        ends_with_newline = not lines[-1]
        if ends_with_newline:
            lines.pop()
        last = len(lines) - 1
        for i, line in enumerate(lines):
            if line and not line.isspace():
                yield self.first_line + i, line, len(line) + (i < last or ends_with_newline)


def read_chunks(files) -> Iterator[_Chunk]:
    """All files in order, about CHUNK_BYTES of whole lines at a time (never the whole corpus).
    The parent only cuts the bytes at newlines: the workers split, parse and encode the lines."""
    for path in files:
        try:
            with _open_binary(path) as f:
                number, pending = 1, []
                while True:
                    block = f.read(CHUNK_BYTES)
                    if not block:
                        if pending:
                            yield _Chunk(path, number, b"".join(pending))
                        break
                    cut = block.rfind(b"\n") + 1
                    if cut == 0:  # inside a line longer than a chunk: read on
                        pending.append(block)
                        continue
                    pending.append(block[:cut] if cut < len(block) else block)
                    data = b"".join(pending)
                    yield _Chunk(path, number, data)
                    number += data.count(b"\n")
                    pending = [block[cut:]] if cut < len(block) else []
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise UserError(f"cannot read input file {path} ({exc}); check that it is intact") from None


def _iter_texts(files, keys) -> Iterator[str]:
    """Texts in input order, for training the sentence splitter (bad lines are skipped here;
    the real pass reports them)."""
    for chunk in read_chunks(files):
        for _, line, _ in chunk.lines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            for key in keys:
                if isinstance(doc, dict) and isinstance(doc.get(key), str):
                    yield doc[key]


# ----------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------


class _Encoder:
    def __init__(self, args, tokenizer: GPT2BPETokenizer, punkt_params) -> None:
        self.keys = list(args.json_keys)
        self.append_eod = args.append_eod
        self.tokenizer = tokenizer
        self.dtype = best_token_dtype(self.tokenizer.vocab_size)
        self.splitter = None
        if punkt_params is not None:
            from megatron_core.data import sentence_split  # nltk: only for --split-sentences

            self.splitter = sentence_split.make_splitter(punkt_params, args.keep_newlines)

    def encode_chunk(self, chunk: _Chunk):
        """Per line: ("ok", {key: (tokens, sentence lengths)}, bytes) or ("bad", line number, why)."""
        out = []
        for number, line, nbytes in chunk.lines():
            try:
                doc = json.loads(line)
            except ValueError as exc:  # JSONDecodeError and invalid UTF-8 alike
                out.append(("bad", number, f"malformed JSON ({exc})"))
                continue
            if not isinstance(doc, dict):
                out.append(("bad", number, f"a JSON line must be an object, got {type(doc).__name__}"))
                continue
            encoded = {}
            for key in self.keys:
                if key not in doc:
                    out.append(
                        ("error", number, f"has no key {key!r} (keys: {', '.join(map(str, doc))}); set --json-keys")
                    )
                    break
                encoded[key] = self._encode_text(doc[key], key)
                if isinstance(encoded[key], str):
                    out.append(("error", number, encoded[key]))
                    break
            else:
                out.append(("ok", encoded, nbytes))
        return chunk.path, out

    def _encode_text(self, value, key):
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            sentences = value  # already split, as Megatron accepts
        elif isinstance(value, str):
            sentences = self.splitter.tokenize(value) if self.splitter is not None else [value]
        else:
            return f"key {key!r} holds a {type(value).__name__}, not a string; the corpus must hold text"
        for sentence in sentences:
            if not sentence.isascii():
                try:
                    sentence.encode("utf-8")
                except UnicodeEncodeError as exc:  # json.loads lets "\ud800" through; it is not text
                    return (
                        f"key {key!r} holds a lone surrogate (U+{ord(sentence[exc.start]):04X} at character "
                        f"{exc.start}), which is not Unicode text; fix its JSON escape (they come in pairs)"
                    )
        # Sentences with no tokens are dropped; the EOD ends the last sentence of a document
        # that has any token.
        arrays = [a for a in map(self.tokenizer.encode_array, sentences) if a.size]
        lengths = [a.size for a in arrays]
        if arrays and self.append_eod:
            arrays.append(np.array([self.tokenizer.eod], dtype=np.uint32))
            lengths[-1] += 1
        ids = np.concatenate(arrays).astype(self.dtype, copy=False) if arrays else np.zeros(0, dtype=self.dtype)
        return ids, lengths


_worker_encoder: Optional[_Encoder] = None


def _init_forked_worker(encoder: _Encoder) -> None:
    """A forked worker shares the parent's tokenizer, already built."""
    global _worker_encoder
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_encoder = encoder


def _init_spawned_worker(args, engine, punkt_params) -> None:
    global _worker_encoder
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file, engine=engine, quiet=True)
    _worker_encoder = _Encoder(args, tokenizer, punkt_params)


def _encode_in_worker(chunk):
    return _worker_encoder.encode_chunk(chunk)


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def _ordered_bounded_map(pool, chunks, in_flight: int):
    """Like pool.imap (results in input order) but with at most in_flight chunks read ahead:
    Pool.imap's feeder thread would read the whole input into memory."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _Progress:
    def __init__(self, interval: int) -> None:
        self.interval = max(1, int(interval))
        self.start = time.perf_counter()
        self.documents = self.bytes = self.tokens = 0

    def add(self, nbytes: int, ntokens: int) -> None:
        self.documents += 1
        self.bytes += nbytes
        self.tokens += ntokens
        if self.documents % self.interval == 0:
            _LOG.info(self.line())

    def line(self) -> str:
        s = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"Processed {self.documents} documents ({self.documents / s:.1f} docs/s, "
            f"{self.bytes / s / 1e6:.2f} MB/s, {self.tokens / s:.0f} tokens/s)."
        )


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def preprocess(args: argparse.Namespace) -> dict:
    """Run the preprocessing described by args (see build_parser); returns a summary dict."""
    if args.tokenizer_type != "GPT2BPETokenizer":
        raise UserError(f"tokenizer type {args.tokenizer_type} is not supported; use GPT2BPETokenizer")
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if args.partitions < 1:
        raise UserError(f"--partitions must be at least 1, got {args.partitions}")
    files = expand_inputs(args.input)
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file, engine=args.tokenizer_engine)
    engine = tokenizer.engine.name
    dtype = best_token_dtype(tokenizer.vocab_size)
    punkt_params = None
    if args.split_sentences:
        from megatron_core.data import sentence_split

        punkt_params = sentence_split.train_punkt(_iter_texts(files, args.json_keys))
        _LOG.info("sentence splitter: punkt trained on the first 4 MB of the input (no download)")
    level = "sentence" if args.split_sentences else "document"
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    prefixes = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
    builders = {
        key: IndexedDatasetBuilder(f"{p}.bin", dtype=dtype, impl=args.dataset_impl) for key, p in prefixes.items()
    }
    progress = _Progress(args.log_interval)
    cpu_start = _cpu_seconds()
    empty = {key: 0 for key in args.json_keys}
    bad_lines = 0
    pool = None
    try:
        chunks = read_chunks(files)
        encoder = _Encoder(args, tokenizer, punkt_params)
        if args.workers == 1:
            results = map(encoder.encode_chunk, chunks)
        else:
            if sys.platform != "darwin":
                ctx = multiprocessing.get_context("fork")
                pool = ctx.Pool(args.workers, initializer=_init_forked_worker, initargs=(encoder,))
            else:
                ctx = multiprocessing.get_context("spawn")
                pool = ctx.Pool(args.workers, initializer=_init_spawned_worker, initargs=(args, engine, punkt_params))
            results = _ordered_bounded_map(pool, chunks, in_flight=4 * args.workers)
        for path, lines in results:
            for result in lines:
                if result[0] != "ok":
                    kind, number, why = result
                    if kind == "bad" and args.skip_bad_lines:
                        bad_lines += 1
                        continue
                    hint = "; fix the line or pass --skip-bad-lines" if kind == "bad" else ""
                    raise UserError(f"{path} line {number}: {why}{hint}")
                _, encoded, nbytes = result
                ntokens = 0
                for key, (ids, lengths) in encoded.items():
                    builders[key].add_document(ids, lengths)
                    empty[key] += not lengths
                    ntokens += len(ids)
                progress.add(nbytes, ntokens)
        if progress.documents == 0:
            raise UserError(f"the input ({', '.join(files)}) holds no documents; give a non-empty JSON-lines file")
        for key, builder in builders.items():
            builder.finalize(f"{prefixes[key]}.idx")
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds = time.perf_counter() - progress.start
    cpu = _cpu_seconds() - cpu_start
    _LOG.info(progress.line())
    summary = {
        "documents": progress.documents,
        "empty_documents_kept": empty,
        "bad_lines_skipped": bad_lines,
        "tokens": progress.tokens,
        "sequences": {key: b.num_sequences for key, b in builders.items()},
        "input_bytes": progress.bytes,
        "seconds": round(seconds, 3),
        "mb_per_s": round(progress.bytes / seconds / 1e6, 3),
        "tokens_per_s": round(progress.tokens / seconds, 1),
        "documents_per_s": round(progress.documents / seconds, 1),
        "workers": args.workers,
        # CPU time of this process and its (joined) workers: on a shared machine MB per CPU
        # second says more about the code than wall-clock MB/s.
        "cpu_seconds": round(cpu, 3),
        "mb_per_cpu_s": round(progress.bytes / max(cpu, 1e-9) / 1e6, 3),
        "tokenizer_engine": engine,
        "dtype": str(dtype),
        "dataset_impl": args.dataset_impl,
        "outputs": prefixes,
    }
    _LOG.info(
        f"done: {summary['documents']} documents ({sum(empty.values())} empty kept as zero-sequence documents, "
        f"{bad_lines} bad lines skipped), {summary['tokens']} tokens in {summary['seconds']} s "
        f"({summary['mb_per_s']} MB/s) -> {', '.join(prefixes.values())}"
    )
    return summary


def main(argv=None) -> int:
    configure()
    args = build_parser().parse_args(argv)
    try:
        preprocess(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
