"""GPT2BPETokenizer: ids equal GPT2TokenizerFast.from_pretrained on both engines; file checks; training."""

import json
import random
import shutil
import warnings

import pytest

from megatron_core.data.tokenizer import (
    EOD_TOKEN,
    GPT2BPETokenizer,
    bytes_to_unicode,
    check_tokenizer_files,
    file_sha256,
    train_bpe_tokenizer,
)
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


def test_auto_engine_verifies_tiktoken_and_logs(capsys):
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    assert tok.engine.name == "tiktoken"
    assert "engine tiktoken (verified" in capsys.readouterr().err
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
