"""GPT2BPETokenizer: ids equal GPT2TokenizerFast.from_pretrained on both engines; the engine choice; file checks;
training."""

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
    alphabet = list("abcXYZ019 _-+*/=()[]{}:;,.'\"#\\\t\n\r") + ["  ", "    ", "\n\n", " \n", "é", "ß", "日本"]
    alphabet += ["🙂", "\u00a0", "\u2003", "'s", "'ll", "'re", "\x00", "\ufeff", "\x0b", "\x0c", "\x1c", "\x1f", "\x85"]
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
    texts = _fixture_texts() + _random_texts() + _whitespace_texts(n=500)
    assert ours.engine.name == engine
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), repr(text[:80])
        assert ours.encode_array(text).tolist() == theirs.encode(text), repr(text[:80])
    assert [ours.encode(t) for t in texts[:20]] == [theirs.encode(t) for t in texts[:20]]
    if engine == "tiktoken":  # JSON may hold a lone surrogate: encoded as U+FFFD (as tiktoken itself does)
        assert ours.encode("a \ud800  b") == ours.encode("a \ufffd  b")


def test_auto_engine_takes_tiktoken_on_well_formed_files_and_logs(capsys):
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    assert tok.engine.name == "tiktoken"
    assert capsys.readouterr().err.splitlines() == [
        "[tokenizer] GPT2BPETokenizer: vocab 955, engine tiktoken (its ranks are the ids, merges in their order)"
    ]
    assert tok.eod == 0 and tok.vocab_size == 955 and tok.vocab[EOD_TOKEN] == 0


def _write_bpe(directory, merges, extra=()):
    """A tiny byte-level BPE: EOD, the 256 bytes, the merges' results, then `extra` tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {EOD_TOKEN: 0}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    for token in [a + b for a, b in merges] + list(extra):
        vocab.setdefault(token, len(vocab))
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (directory / "merges.txt").write_text(merges_text, encoding="utf-8")
    return directory / "vocab.json", directory / "merges.txt"


def _reorder_ids(vocab_file, order):
    """Give the merged tokens (ids above 256) their ids in `order` (a function of the sorted list)."""
    data = json.loads(vocab_file.read_text(encoding="utf-8"))
    merged = sorted((t for t, i in data.items() if i > 256), key=data.get)
    data.update(zip(merged, order(sorted(data[t] for t in merged))))
    vocab_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


_MERGES = [("a", "b"), ("b", "c"), ("c", "d"), ("ab", "c")]


# Each vocab makes tiktoken on ranks = ids differ from GPT-2's BPE on one of the texts below.
@pytest.mark.parametrize(
    "case, merges, why",
    [
        # "abc" is a+bc (before c+d) and ab+c (after): tiktoken ranks tokens, not pairs, so it turns
        # "abcd" into [abc, d] where GPT-2 has [ab, cd].
        (
            "made twice",
            [("a", "b"), ("b", "c"), ("a", "bc"), ("c", "d"), ("ab", "c")],
            "merge result 'abc' is made by two merges",
        ),
        # "xyz" is in the vocab but no merge makes it: tiktoken would return it for "xyz", GPT-2 never.
        ("no merge", _MERGES, "1 multi-byte tokens of vocab.json are made by no merge"),
        # Ids not growing with the merge order: tiktoken would merge in id order ("bcd": [b, cd]), GPT-2
        # in merge order ([bc, d]).
        ("ids reversed", _MERGES, "merges.txt line 3 (b c) is out of the vocab ids' order"),
    ],
)
def test_auto_falls_back_to_exact_engine_where_ranks_cannot_express_the_merges(tmp_path, capsys, case, merges, why):
    vocab, merges_file = _write_bpe(tmp_path, merges, extra=["xyz"] if case == "no merge" else ())
    if case == "ids reversed":
        _reorder_ids(vocab, lambda ids: ids[::-1])
    tok = GPT2BPETokenizer(vocab, merges_file)
    assert tok.engine.name == "hf"
    assert capsys.readouterr().err.splitlines() == [  # one line says why
        f"[tokenizer] GPT2BPETokenizer: vocab {tok.vocab_size}, engine hf "
        f"(tiktoken cannot represent these files: {why})"
    ]
    theirs = _hf(tmp_path)
    for text in ["abc", "abcd", "bcd", "xyz", "abcabc bc ab", "a bcd\n\nabcab"]:
        assert tok.encode(text) == theirs.encode(text), text
    with pytest.raises(UserError, match="tiktoken cannot represent these files.*use engine hf"):
        GPT2BPETokenizer(vocab, merges_file, engine="tiktoken")


def test_tiktoken_engine_on_a_trained_vocab_with_whitespace_edges(tmp_path):
    # GPT-2's pattern splits a whitespace run before a non-space (its lookahead): "\n    x" -> "\n   ", " x".
    texts = _whitespace_texts(seed=1)
    vocab, merges = train_bpe_tokenizer(iter(texts * 3), 1200, tmp_path / "tok", min_frequency=2)
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.engine.name == "tiktoken"
    exact = GPT2BPETokenizer(vocab, merges, engine="hf")
    for text in texts + _whitespace_texts(seed=2, n=500):
        assert tok.encode_array(text).tolist() == exact.encode(text), repr(text)


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


_SPACES = [" ", "\t", "\n", "\x0b", "\x0c", "\r", "\x85", "\xa0", "\u1680", "\u2003", "\u2028", "\u3000"]
_NOT_SPACES = ["\x1c", "\x1f", "\u200b", "\ufeff", "\u180e"]  # str.isspace() says yes for \x1c-\x1f
_CONTROLS = ["\x00", "\x01", "\x08", "\x0e", "\x1b", "\x7f"]
_AFTER = ["a", "Z", "é", "ж", "日", "1", "٣", "!", "(", "'s", "'ll", "🙂", "_"]


def _whitespace_texts(seed=0, n=1500):
    rng = random.Random(seed)
    alphabet = _SPACES * 3 + _NOT_SPACES + _CONTROLS + _AFTER + ["  ", "    ", "\n    ", "x"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(n)]
    for w in _SPACES + _NOT_SPACES:
        for x in _AFTER + [""]:
            # runs of one to three before a letter, digit, punctuation, contraction, end of text
            texts += [w + x, " " + w + x, w + w + x, w + " " + x, w + w + w + x, "q" + w + w + x + w + w]
    texts += [z + "  a" for z in _CONTROLS] + [" a  b" + z + "  c" for z in _CONTROLS]
    texts += ["", " ", "  ", " !", "a !", "a  !", "a\n\n\tb", "x" + " " * 50 + "y", "\n" * 9 + "z"]
    texts += ["if x:\n    return 1\n"]
    return texts
