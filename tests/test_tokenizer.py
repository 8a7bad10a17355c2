"""GPT2BPETokenizer: ids equal GPT2TokenizerFast.from_pretrained on both engines; file checks; training."""

import io
import json
import random
import shutil
import warnings

import numpy as np
import pytest

from megatron_core.data.tokenizer import (
    EOD_TOKEN,
    GPT2BPETokenizer,
    bytes_to_unicode,
    check_tokenizer_files,
    file_sha256,
    train_bpe_tokenizer,
)
from megatron_core.data import tokenizer as tokenizer_module
from megatron_core.errors import UserError

from training_fixtures import MEGATRON_PREPROCESS_FIXTURE as FIXTURE


def _hf(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import GPT2TokenizerFast

        return GPT2TokenizerFast.from_pretrained(str(directory))


def _random_texts(seed=0, n=300):
    rng = random.Random(seed)
    alphabet = list("abcXYZ019 _-+*/=()[]{}:;,.'\"#\\\t\n\r") + ["  ", "    ", "\n\n", " \n", "é", "ß", "日本", "🙂", "\u00a0", "\u2003", "'s", "'ll", "'re", "\x00", "\ufeff", "\x0b", "\x0c", "\x1c", "\x1f", "\x85"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(n)]
    texts += ["".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(rng.randint(1, 30))) for _ in range(100)]
    texts = [t.encode("utf-8", "replace").decode("utf-8", "replace") for t in texts]
    ascii_only = [t.encode("ascii", "ignore").decode() for t in texts[:200]]  # the ASCII fast path
    return texts + ascii_only + ["", " ", "   \n\t  \n", "x" * 5000, " " * 1000 + "y", "def f():\n\treturn 1\n" * 50]


def _fixture_texts():
    with open(FIXTURE / "corpus.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["content"] for line in f]


@pytest.mark.parametrize("engine", ["tiktoken", "hf"])
def test_ids_equal_gpt2_tokenizer_fast(engine):
    ours = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt", engine=engine)
    theirs = _hf(FIXTURE)
    texts = _fixture_texts() + _random_texts()
    assert ours.engine.name == engine
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text[:80]
    assert ours.encode_batch(texts[:20]) == [theirs.encode(t) for t in texts[:20]]


def test_auto_engine_verifies_tiktoken_and_logs(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_CORE_TOKENIZER_CACHE", str(tmp_path))  # empty: the probe must run here
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    assert tok.engine.name == "tiktoken"
    err = capsys.readouterr().err
    assert "engine tiktoken (verified equal to the exact BPE on" in err and "cached in" not in err
    assert tok.eod == 0 and tok.vocab_size == 955 and tok.vocab[EOD_TOKEN] == 0


def _write_bpe(directory, merges):
    """A tiny byte-level BPE: EOD, the 256 bytes, then the merges' results."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {EOD_TOKEN: 0}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return directory / "vocab.json", directory / "merges.txt"


def test_auto_falls_back_to_exact_engine_where_tiktoken_differs(tmp_path, capsys):
    # "abc" is made from a+bc, so GPT-2's BPE leaves "abc" as [ab, c]; tiktoken would join them.
    vocab, merges = _write_bpe(tmp_path, [("a", "b"), ("b", "c"), ("a", "bc")])
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.engine.name == "hf"
    assert "tiktoken differs" in capsys.readouterr().err
    assert tok.encode("abc") == _hf(tmp_path).encode("abc")
    assert GPT2BPETokenizer(vocab, merges, engine="tiktoken").encode("abc") != tok.encode("abc")


def test_literal_eod_text_is_plain_text_as_in_megatron():
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    text = f"x = 1{EOD_TOKEN}y"
    assert tok.eod not in tok.encode(text)
    assert tok.encode(text) == _hf(FIXTURE).encode(text, split_special_tokens=True)


def test_decode_roundtrip():
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    for text in _random_texts(seed=1)[:50] + _fixture_texts()[:20]:
        assert tok.decode(tok.encode(text)) == text


def test_check_tokenizer_files_names_the_problem(tmp_path):
    vocab, merges = _write_bpe(tmp_path / "ok", [("a", "b"), ("ab", "c")])
    check_tokenizer_files(vocab, merges)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ok", bad)
    with open(bad / "merges.txt", "a", encoding="utf-8") as f:
        f.write("x yz\n")
    with pytest.raises(UserError, match=r"line 4 \(x yz\).*'yz'"):
        check_tokenizer_files(bad / "vocab.json", bad / "merges.txt")
    data = json.loads(vocab.read_text(encoding="utf-8"))
    del data[EOD_TOKEN]
    (bad / "vocab.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(UserError, match="endoftext"):
        check_tokenizer_files(bad / "vocab.json", merges)
    with pytest.raises(UserError, match="does not exist"):
        check_tokenizer_files(tmp_path / "nope.json", merges)
    (bad / "vocab.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match="vocab.json"):
        GPT2BPETokenizer(bad / "vocab.json", merges)


def test_train_bpe_tokenizer_writes_gpt2_files(tmp_path):
    texts = _fixture_texts()
    vocab, merges = train_bpe_tokenizer(iter(texts), 600, tmp_path / "tok", min_frequency=2)
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["merges.txt", "vocab.json"]
    check_tokenizer_files(vocab, merges)
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.eod == 0 and tok.vocab_size == 600
    assert merges.read_text(encoding="utf-8").startswith("#version: 0.2\n")
    theirs = _hf(tmp_path / "tok")
    for text in texts[:100] + _random_texts(seed=2)[:100]:
        assert tok.encode(text) == theirs.encode(text)
    # Deterministic: the same texts give the same files.
    vocab2, merges2 = train_bpe_tokenizer(iter(texts), 600, tmp_path / "tok2")
    assert file_sha256(vocab) == file_sha256(vocab2) and file_sha256(merges) == file_sha256(merges2)
    with pytest.raises(UserError, match="empty"):
        train_bpe_tokenizer(iter([]), 600, tmp_path / "tok3")


# ----------------------------------------------------------------------------------------------
# The tiktoken engine's marker: GPT-2's split without the lookahead
# ----------------------------------------------------------------------------------------------

_SPACES = [" ", "\t", "\n", "\x0b", "\x0c", "\r", "\x85", "\xa0", "\u1680", "\u2003", "\u2028", "\u3000"]
_NOT_SPACES = ["\x1c", "\x1f", "\u200b", "\ufeff", "\u180e"]  # str.isspace() says yes for \x1c-\x1f
_MARKERS = ["\x00", "\x01", "\x08", "\x0e", "\x1b", "\x7f"]
_AFTER = ["a", "Z", "é", "ж", "日", "1", "٣", "!", "(", "'s", "'ll", "🙂", "_"]


def _merges_making(strings):
    """Merges that make each string one token, left to right, so that piece boundaries show in
    the ids (a vocab that cannot tell " " + "\\na" from " \\n" + "a" would prove nothing)."""
    b2u = bytes_to_unicode()
    merges, made = [], set()
    for s in strings:
        chars = [b2u[b] for b in s.encode("utf-8")]
        current = chars[0]
        for c in chars[1:]:
            if current + c not in made:
                merges.append((current, c))
                made.add(current + c)
            current += c
    return merges


def _whitespace_vocab_strings():
    strings = [a + b for a in _SPACES + _NOT_SPACES for b in _SPACES + _NOT_SPACES]
    strings += [w + x for w in _SPACES + _NOT_SPACES + ["  ", "\n "] for x in _AFTER]
    strings += ["   ", "    ", "\n    ", "\n\n", " \n", "\t\t", "ab", "abc", "11", "!!"]
    return strings


def _whitespace_texts(seed=0, n=1500):
    rng = random.Random(seed)
    alphabet = _SPACES * 3 + _NOT_SPACES + _MARKERS + _AFTER + ["  ", "    ", "\n    ", "x"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(n)]
    for w in _SPACES + _NOT_SPACES:
        for x in _AFTER + [""]:
            # runs of one to three before a letter, digit, punctuation, contraction, end of text
            texts += [w + x, " " + w + x, w + w + x, w + " " + x, w + w + w + x, "q" + w + w + x + w + w]
    texts += [z + "  a" for z in _MARKERS] + [" a  b" + z + "  c" for z in _MARKERS]
    texts += ["", " ", "  ", " !", "a !", "a  !", "a\n\n\tb", "x" + " " * 50 + "y", "\n" * 9 + "z", "if x:\n    return 1\n"]
    return texts


def _assert_equal(tok, reference, texts):
    for text in texts:
        assert tok.encode(text) == reference(text), repr(text)
        assert tok.encode_array(text).tolist() == reference(text), repr(text)


def _gpt2_pattern(tok):
    """tiktoken on the same ranks with GPT-2's own split pattern (lookahead included)."""
    return lambda text: tok.engine.encode_gpt2_pattern(text).tolist()


def test_marker_split_equals_gpt2_split_where_they_differ(tmp_path):
    # Handmade merges join whitespace with what follows, so every piece boundary shows in the ids.
    # (Such a vocab is no ordinary BPE: tiktoken's ranks and the exact BPE may disagree on it, so
    # the reference is tiktoken with GPT-2's pattern; the next test compares with the exact BPE.)
    vocab, merges = _write_bpe(tmp_path, _merges_making(_whitespace_vocab_strings()))
    tok = GPT2BPETokenizer(vocab, merges, engine="tiktoken")
    assert tok.engine.marker == "\x00"
    _assert_equal(tok, _gpt2_pattern(tok), _whitespace_texts())


def test_marker_engine_equals_exact_bpe_on_whitespace_edges(tmp_path):
    texts = _whitespace_texts(seed=1)
    vocab, merges = train_bpe_tokenizer(iter(texts * 3), 1200, tmp_path / "tok", min_frequency=2)
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.engine.name == "tiktoken" and tok.engine.marker is not None
    exact = GPT2BPETokenizer(vocab, merges, engine="hf")
    _assert_equal(tok, exact.encode, texts + _whitespace_texts(seed=2, n=500))


def test_marker_skips_merged_bytes_and_falls_back_when_none_is_free(tmp_path):
    texts = _whitespace_texts(seed=3, n=600)
    # A vocab that merges "\x00" and "\x01" with a space: the marker must be another byte.
    some = texts * 2 + [" \x00 \x00 \x01 \x01" * 30] * 5
    vocab, merges = train_bpe_tokenizer(iter(some), 800, tmp_path / "some", min_frequency=2)
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.engine.name == "tiktoken" and tok.engine.marker == "\x02"
    _assert_equal(tok, GPT2BPETokenizer(vocab, merges, engine="hf").encode, texts)
    # Every candidate merged: no marker, GPT-2's own pattern.
    candidates = tokenizer_module._MARKER_CANDIDATES
    every = texts * 2 + ["".join(c * 2 + " " for c in candidates) * 30] * 5
    vocab, merges = train_bpe_tokenizer(iter(every), 800, tmp_path / "all", min_frequency=2)
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.engine.name == "tiktoken" and tok.engine.marker is None
    _assert_equal(tok, GPT2BPETokenizer(vocab, merges, engine="hf").encode, texts)


def test_marker_engine_with_ids_out_of_merge_order(tmp_path):
    # Ids that do not grow with the merge order: the engine maps tiktoken's ranks to the ids.
    texts = _whitespace_texts(seed=4, n=600)
    vocab, merges = train_bpe_tokenizer(iter(texts * 3), 600, tmp_path / "tok", min_frequency=2)
    data = json.loads(vocab.read_text(encoding="utf-8"))
    merged = [t for t, i in data.items() if i > 256]
    for token, new_id in zip(merged, sorted((data[t] for t in merged), reverse=True)):
        data[token] = new_id
    vocab.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    tok = GPT2BPETokenizer(vocab, merges, engine="tiktoken")
    assert tok.engine._rank_to_id is not None
    _assert_equal(tok, GPT2BPETokenizer(vocab, merges, engine="hf").encode, texts)


def test_fixture_vocab_on_whitespace_edges_and_lone_surrogates():
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt", engine="tiktoken")
    theirs = _hf(FIXTURE)
    for text in _whitespace_texts(seed=3, n=500) + _fixture_texts()[:30]:
        assert tok.encode(text) == theirs.encode(text), repr(text)
    # JSON may hold a lone surrogate; it is encoded as U+FFFD (as tiktoken itself does).
    assert tok.encode("a \ud800  b") == tok.encode("a \ufffd  b")


# ----------------------------------------------------------------------------------------------
# The probe's verdict, cached
# ----------------------------------------------------------------------------------------------


def test_probe_verdict_is_cached_per_files_and_can_be_turned_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_CORE_TOKENIZER_CACHE", str(tmp_path / "cache"))
    probes = []
    real_probe = GPT2BPETokenizer._probe
    monkeypatch.setattr(GPT2BPETokenizer, "_probe", lambda self, *a: probes.append(1) or real_probe(self, *a))
    vocab, merges = _write_bpe(tmp_path / "tok", _merges_making(["ab", "  ", "\n "]))
    assert GPT2BPETokenizer(vocab, merges).engine.name == "tiktoken" and len(probes) == 1
    assert GPT2BPETokenizer(vocab, merges).engine.name == "tiktoken" and len(probes) == 1
    assert "(cached in " in capsys.readouterr().err
    cached, tables = sorted((tmp_path / "cache").iterdir())
    assert (cached.name, tables.suffix) == (tables.stem + ".json", ".npz") and cached.name.startswith("verdict-")
    assert not list(tmp_path.joinpath("tok").glob("verdict*"))
    # The engine from the cached tables encodes as the one built from the files.
    built = GPT2BPETokenizer(vocab, merges, engine="tiktoken", quiet=True)
    texts = _whitespace_texts(seed=5, n=200)
    assert [GPT2BPETokenizer(vocab, merges).encode(t) for t in texts] == [built.encode(t) for t in texts]
    # Other files: another verdict. Damaged tables: built again without a probe; a damaged verdict: probe again.
    other_vocab, other_merges = _write_bpe(tmp_path / "other", _merges_making(["ab", "abc"]))
    GPT2BPETokenizer(other_vocab, other_merges)
    assert len(probes) == 2 and len(list((tmp_path / "cache").iterdir())) == 4
    other_tables = next(p for p in (tmp_path / "cache").glob("*.npz") if p != tables).read_bytes()
    # Truncated, empty (a crash before the rename was fsynced), not a zip, whole but another vocab's
    # tables (their digest seals other files), or an earlier version's tables without a digest: all
    # built again, no probe.
    with np.load(tables) as whole:
        undigested = io.BytesIO()
        np.savez(undigested, **{key: whole[key] for key in whole.files if key != "digest"})
    for damaged in (b"PK not a zip", tables.read_bytes()[:200], b"", other_tables, undigested.getvalue()):
        tables.write_bytes(damaged)
        capsys.readouterr()
        assert GPT2BPETokenizer(vocab, merges).encode("ab  ab") == built.encode("ab  ab") and len(probes) == 2
        assert "rebuilding it" in capsys.readouterr().err  # said, not silent
    cached.write_text("{not json", encoding="utf-8")
    GPT2BPETokenizer(vocab, merges)
    assert len(probes) == 3
    cached.chmod(0o666)  # a verdict someone else could have written is not trusted: probe again
    GPT2BPETokenizer(vocab, merges)
    assert len(probes) == 4
    cached.chmod(0o644)
    GPT2BPETokenizer(vocab, merges)
    assert len(probes) == 4
    monkeypatch.setenv("MEGATRON_CORE_TOKENIZER_CACHE", "0")
    GPT2BPETokenizer(vocab, merges)
    GPT2BPETokenizer(vocab, merges)
    assert len(probes) == 6


def test_cached_negative_verdict_keeps_the_exact_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_CORE_TOKENIZER_CACHE", str(tmp_path / "cache"))
    vocab, merges = _write_bpe(tmp_path, [("a", "b"), ("b", "c"), ("a", "bc")])
    assert GPT2BPETokenizer(vocab, merges).engine.name == "hf"
    monkeypatch.setattr(GPT2BPETokenizer, "_probe", lambda self, *a: pytest.fail("probed again"))
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.engine.name == "hf" and "tiktoken differs" in capsys.readouterr().err
    assert tok.encode("abc") == _hf(tmp_path).encode("abc")


def test_ascii_marking_equals_the_regex_marking():
    from megatron_core.data.tokenizer import _MARK_AT, _mark_ascii

    rng = random.Random(6)
    alphabet = [" ", "\t", "\n", "\x0b", "\x0c", "\r", "\x1c", "\x1f", "\x08", "\x0e", "a", "!", "  "]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    for text in texts + ["", " ", "  ", "  a", "a  ", "x\n\n    y\n"]:
        assert _mark_ascii(text, 0) == _MARK_AT.sub("\x00", text), repr(text)
