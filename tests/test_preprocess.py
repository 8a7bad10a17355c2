"""preprocess: byte-identical to Megatron-LM on the golden fixture; flags; errors leave no output."""

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_core.data.indexed_dataset import IndexedDataset
from megatron_core.data.preprocess import main, preprocess, preprocess_args
from megatron_core.data.tokenizer import GPT2BPETokenizer

from training_fixtures import MEGATRON_PREPROCESS_FIXTURE as FIXTURE

VOCAB, MERGES = str(FIXTURE / "vocab.json"), str(FIXTURE / "merges.txt")


def _args(inputs, prefix, **options):
    options = {"json_keys": ["content"], "log_interval": 100, **options}
    return preprocess_args(
        input=[str(p) for p in inputs], output_prefix=str(prefix), vocab_file=VOCAB, merge_file=MERGES, **options
    )


def _read(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_indices.tolist()


@pytest.mark.parametrize("workers", [1, 2])
def test_golden_byte_identical_to_megatron(tmp_path, workers):
    summary = preprocess(_args([FIXTURE / "corpus.jsonl"], tmp_path / "megatron", append_eod=True, workers=workers))
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"megatron_content_document.{ext}").read_bytes()
        assert ours == (FIXTURE / f"megatron_content_document.{ext}").read_bytes(), ext
    assert summary["documents"] == 301 and summary["empty_documents_kept"] == {"content": 10}
    assert summary["sequences"] == {"content": 291}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "megatron_content_document.bin",
        "megatron_content_document.idx",
    ]


def test_cli_golden_and_progress_line(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_core.data.preprocess",
            "--input",
            str(FIXTURE / "corpus.jsonl"),
            "--output-prefix",
            str(tmp_path / "m"),
            "--vocab-file",
            VOCAB,
            "--merge-file",
            MERGES,
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--json-keys",
            "content",
            "--append-eod",
            "--workers",
            "2",
            "--partitions",
            "2",
            "--log-interval",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "Processed 300 documents (" in run.stderr and "MB/s" in run.stderr and "tokens/s" in run.stderr
    assert "10 empty kept" in run.stderr
    reference = (FIXTURE / "megatron_content_document.idx").read_bytes()
    assert (tmp_path / "m_content_document.idx").read_bytes() == reference


def test_ids_match_gpt2_tokenizer_fast_and_megatron_core_reads_them(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
        from transformers import GPT2TokenizerFast
    hf = GPT2TokenizerFast.from_pretrained(str(FIXTURE))
    preprocess(_args([FIXTURE / "corpus.jsonl"], tmp_path / "d", append_eod=True))
    theirs = MegatronIndexedDataset(str(tmp_path / "d_content_document"))
    docs = [json.loads(line)["content"] for line in open(FIXTURE / "corpus.jsonl", encoding="utf-8")]
    bounds = theirs.document_indices
    for d, text in enumerate(docs):
        got = [t for s in range(bounds[d], bounds[d + 1]) for t in theirs[s].tolist()]
        expected = hf.encode(text)
        assert got == (expected + [0] if expected else []), d


def test_legacy_impls_hold_the_same_tokens(tmp_path):
    corpus = [FIXTURE / "corpus.jsonl"]
    preprocess(_args(corpus, tmp_path / "mmap", append_eod=True))
    reference = _read(tmp_path / "mmap_content_document")
    for impl in ("lazy", "cached"):
        preprocess(_args(corpus, tmp_path / impl, append_eod=True, dataset_impl=impl))
        assert (tmp_path / f"{impl}_content_document.idx").read_bytes()[:8] == b"TNTIDX\x00\x00"
        assert _read(tmp_path / f"{impl}_content_document") == reference
        assert (tmp_path / f"{impl}_content_document.bin").read_bytes() == (
            tmp_path / "mmap_content_document.bin"
        ).read_bytes()


def test_several_keys_gzip_and_globs(tmp_path):
    rows = [{"content": f"def f{i}(): return {i}\n", "title": f"T{i}", "n": i} for i in range(7)]
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "in" / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:4])
    with open(tmp_path / "in" / "b.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[4:])
    args = _args([tmp_path / "in" / "*.jsonl*"], tmp_path / "out" / "x", json_keys=["content", "title"], workers=2)
    summary = preprocess(args)
    assert summary["documents"] == 7
    tok = GPT2BPETokenizer(VOCAB, MERGES, quiet=True)
    for key in ("content", "title"):
        seqs, docs = _read(tmp_path / "out" / f"x_{key}_document")
        assert seqs == [tok.encode(r[key]) for r in rows]  # no --append-eod: no EOD
        assert docs == list(range(8))


def test_split_sentences_offline(tmp_path):
    text = "The first sentence is here. The second one follows it. Dr. Watson came too! Is it over? Yes."
    rows = [{"content": text}, {"content": ""}, {"content": "One line only"}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    summary = preprocess(_args([path], tmp_path / "s", split_sentences=True, append_eod=True))
    assert summary["outputs"] == {"content": str(tmp_path / "s_content_sentence")}
    ds = IndexedDataset(tmp_path / "s_content_sentence")
    tok = GPT2BPETokenizer(VOCAB, MERGES, quiet=True)
    docs = ds.document_indices.tolist()
    assert len(docs) == 4 and docs[2] - docs[1] == 0  # the empty document stays, with no sentences
    first = [tok.decode(ds[i]) for i in range(docs[0], docs[1])]
    assert len(first) >= 4 and first[-1].endswith("Yes.<|endoftext|>")
    assert " ".join(s.replace("<|endoftext|>", "") for s in first) == text
    assert ds[docs[2]].tolist()[-1] == tok.eod


def _cli(tmp_path, inputs, *extra, vocab=VOCAB, merges=MERGES):
    argv = [
        "--input",
        *map(str, inputs),
        "--output-prefix",
        str(tmp_path / "out" / "p"),
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--json-keys",
        "content",
        "--append-eod",
        *extra,
    ]
    return main(argv)


def _assert_fails_cleanly(tmp_path, capsys, code, pattern):
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and __import__("re").search(pattern, lines[0]), err
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == []


def _corpus(tmp_path, lines, name="c.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = [json.dumps({"content": f"x = {i}"}) for i in range(300)]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_malformed_json_names_file_and_line(tmp_path, capsys, workers):
    path = _corpus(tmp_path, GOOD + ['{"content": "broken'] + GOOD)
    _assert_fails_cleanly(
        tmp_path, capsys, _cli(tmp_path, [path], "--workers", workers), r"c\.jsonl line 301: malformed JSON"
    )


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    path = _corpus(tmp_path, GOOD[:3] + ["not json", "[1, 2]"] + GOOD[3:5])
    summary = preprocess(_args([path], tmp_path / "p", skip_bad_lines=True))
    assert summary["bad_lines_skipped"] == 2 and summary["documents"] == 5
    assert "2 bad lines skipped" in capsys.readouterr().err


def test_missing_key(tmp_path, capsys):
    path = _corpus(tmp_path, GOOD[:2] + [json.dumps({"text": "x"})])
    _assert_fails_cleanly(tmp_path, capsys, _cli(tmp_path, [path]), r"line 3: has no key 'content'.*--json-keys")


def test_non_string_value(tmp_path, capsys):
    path = _corpus(tmp_path, [json.dumps({"content": 12})])
    _assert_fails_cleanly(tmp_path, capsys, _cli(tmp_path, [path]), r"line 1: key 'content' holds a int, not a string")


def test_empty_input(tmp_path, capsys):
    path = _corpus(tmp_path, [])
    _assert_fails_cleanly(tmp_path, capsys, _cli(tmp_path, [path]), r"holds no documents")


def test_missing_and_unreadable_files(tmp_path, capsys):
    _assert_fails_cleanly(tmp_path, capsys, _cli(tmp_path, [tmp_path / "nope.jsonl"]), r"nope\.jsonl does not exist")
    _assert_fails_cleanly(tmp_path, capsys, _cli(tmp_path, [tmp_path / "*.jsonl"]), r"matches no file")
    bad_gz = tmp_path / "bad.jsonl.gz"
    bad_gz.write_bytes(b"this is not gzip")
    _assert_fails_cleanly(tmp_path, capsys, _cli(tmp_path, [bad_gz]), r"cannot read input file .*bad\.jsonl\.gz")


def test_vocab_and_merges_that_disagree(tmp_path, capsys):
    vocab = json.loads(Path(VOCAB).read_text(encoding="utf-8"))
    some_merged = [t for t in vocab if len(t) > 3 and t != "<|endoftext|>"][0]
    del vocab[some_merged]
    bad = tmp_path / "vocab.json"
    bad.write_text(json.dumps(vocab), encoding="utf-8")
    path = _corpus(tmp_path, GOOD[:2])
    _assert_fails_cleanly(
        tmp_path, capsys, _cli(tmp_path, [path], vocab=str(bad)), r"merges\.txt line \d+ .*do not belong together"
    )


def test_a_lone_surrogate_is_refused_with_its_line(tmp_path, capsys):
    """JSON can escape half a surrogate pair ("\\ud800"); that is no text to tokenize (Megatron-LM
    crashes on it): one line names the file's line, nothing is written. A whole pair is an emoji."""
    path = _corpus(tmp_path, [json.dumps({"content": "ok \U0001f600"}), '{"content": "a\\ud800b"}'])
    _assert_fails_cleanly(
        tmp_path,
        capsys,
        _cli(tmp_path, [path], "--workers", "2"),
        r"line 2: key 'content' holds a lone surrogate \(U\+D800 at character 1\)",
    )


def test_failure_after_output_started_leaves_nothing(tmp_path, capsys):
    # Thousands of good documents are written before the bad one is met.
    path = _corpus(tmp_path, GOOD * 10 + [json.dumps({"content": None})])
    _assert_fails_cleanly(
        tmp_path, capsys, _cli(tmp_path, [path], "--workers", "2"), r"line 3001: key 'content' holds a NoneType"
    )


def test_workers_read_ahead_a_bounded_number_of_chunks(tmp_path, monkeypatch):
    import multiprocessing

    from megatron_core.data import preprocess as pp

    path = _corpus(tmp_path, GOOD * 20)
    monkeypatch.setattr(pp, "CHUNK_BYTES", path.stat().st_size // 24 + 1)
    read = []

    def counted_chunks():
        for chunk in pp.read_chunks([str(path)]):
            read.append(chunk)
            yield chunk

    args = _args([path], tmp_path / "unused")
    encoder = pp._Encoder(args, GPT2BPETokenizer(VOCAB, MERGES, engine="tiktoken", quiet=True), None)
    with multiprocessing.get_context("fork").Pool(1, initializer=pp._init_forked_worker, initargs=(encoder,)) as pool:
        results = pp._ordered_bounded_map(pool, counted_chunks(), in_flight=3)
        first = next(results)
        assert len(read) <= 3  # Pool.imap would have queued all the chunks by now
        rest = list(results)
    assert len(read) >= 24 and len(rest) == len(read) - 1 and first[1][0][0] == "ok"
    assert sum(len(lines) for _, lines in [first, *rest]) == len(GOOD) * 20


def test_chunks_cut_at_newlines_keep_line_numbers_and_sizes(tmp_path, monkeypatch):
    from megatron_core.data import preprocess as pp

    long = json.dumps({"content": "y" * 5000})
    lines = ["", *GOOD[:40], "  ", long, *GOOD[40:80], "\t", long]
    path = tmp_path / "c.jsonl"
    path.write_bytes(("\n".join(lines)).encode())  # the last line has no newline
    expected = [(n, line.encode(), len(line) + (n < len(lines))) for n, line in enumerate(lines, 1) if line.strip()]
    for chunk_bytes in (7, 100, 1000, 1 << 20):  # chunks shorter than a line, and longer than the file
        monkeypatch.setattr(pp, "CHUNK_BYTES", chunk_bytes)
        got = [entry for chunk in pp.read_chunks([str(path)]) for entry in chunk.lines()]
        assert got == expected, chunk_bytes


def test_keep_newlines_keeps_every_character(tmp_path):
    text = "First line here.\nSecond sentence follows.\n\nA third one! And a fourth?\n"
    path = _corpus(tmp_path, [json.dumps({"content": text})] * 3)
    preprocess(_args([path], tmp_path / "k", split_sentences=True, keep_newlines=True))
    ds = IndexedDataset(tmp_path / "k_content_sentence")
    tok = GPT2BPETokenizer(VOCAB, MERGES, quiet=True)
    docs = ds.document_indices.tolist()
    sentences = [tok.decode(ds[i]) for i in range(docs[0], docs[1])]
    # Inner newlines stay with their sentences; punkt drops only whitespace at the very end.
    assert len(sentences) >= 3 and "".join(sentences) == text.rstrip()
