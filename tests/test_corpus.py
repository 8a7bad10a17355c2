"""build_corpus: stdlib, jsonl(.gz) and hf-dataset sources, limits, atomic output."""

import gzip
import json
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_core.config import HfDatasetSource, JsonlSource, PythonStdlibSource
from megatron_core.data.corpus import build_corpus
from megatron_core.errors import UserError


def _lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_python_stdlib_is_sorted_deterministic_and_real(tmp_path):
    s1 = build_corpus([PythonStdlibSource()], tmp_path / "a.jsonl", max_documents=40)
    build_corpus([PythonStdlibSource()], tmp_path / "b.jsonl", max_documents=40)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    docs = _lines(tmp_path / "a.jsonl")
    assert s1["documents"] == 40 and len(docs) == 40
    paths = [d["path"] for d in docs]
    assert paths == sorted(paths) and all(p.endswith(".py") for p in paths)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert docs[0]["content"] == (root / docs[0]["path"]).read_text(encoding="utf-8")
    assert all(d["source"] == "python-stdlib" for d in docs)


def test_stdlib_shuffle_seed_is_a_fixed_permutation_of_the_same_files(tmp_path):
    build_corpus([PythonStdlibSource(shuffle_seed=7)], tmp_path / "a.jsonl", max_bytes=2_000_000)
    build_corpus([PythonStdlibSource(shuffle_seed=7)], tmp_path / "b.jsonl", max_bytes=2_000_000)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    shuffled = [d["path"] for d in _lines(tmp_path / "a.jsonl")]
    assert shuffled != sorted(shuffled)  # drawn from the whole library, not its first packages
    assert len({p.split("/")[0] for p in shuffled}) > 10
    other = build_corpus([PythonStdlibSource(shuffle_seed=8)], tmp_path / "c.jsonl", max_documents=20)
    assert other["documents"] == 20 and [d["path"] for d in _lines(tmp_path / "c.jsonl")] != shuffled[:20]


def test_stdlib_excludes_site_packages_and_respects_max_bytes(tmp_path):
    summary = build_corpus([PythonStdlibSource()], tmp_path / "c.jsonl", max_bytes=300_000)
    docs = _lines(tmp_path / "c.jsonl")
    assert 0 < summary["content_bytes"] <= 300_000
    assert sum(len(d["content"].encode()) for d in docs) == summary["content_bytes"]
    assert not any("site-packages" in d["path"] or "dist-packages" in d["path"] for d in docs)


def test_jsonl_and_gz_globs(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(json.dumps({"code": "a = 1"}) + "\n\n" + json.dumps({"code": "b"}) + "\n")
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"code": "ü"}) + "\n")
    source = JsonlSource(paths=(str(tmp_path / "in" / "*.jsonl*"),), key="code")
    summary = build_corpus([source, PythonStdlibSource()], tmp_path / "out.jsonl", max_documents=5)
    docs = _lines(tmp_path / "out.jsonl")
    assert [d["content"] for d in docs[:3]] == ["a = 1", "b", "ü"]
    assert docs[1]["line"] == 3 and docs[2]["path"].endswith("b.jsonl.gz")
    assert summary["per_source"] == {"jsonl": 3, "python-stdlib": 2}


def test_hf_dataset_from_disk_and_parquet_folder(tmp_path):
    import datasets

    rows = {"content": ["def a(): pass", "x = 2", "print(3)"], "repo": ["r1", "r2", "r3"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "saved"))
    source = HfDatasetSource(name=str(tmp_path / "saved"), revision="local", split="train", key="content")
    build_corpus([source], tmp_path / "a.jsonl")
    docs = _lines(tmp_path / "a.jsonl")
    assert [d["content"] for d in docs] == rows["content"] and docs[2]["row"] == 2
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    build_corpus([replace(source, name=str(tmp_path / "pq"))], tmp_path / "b.jsonl", max_documents=2)
    assert [d["content"] for d in _lines(tmp_path / "b.jsonl")] == rows["content"][:2]
    with pytest.raises(UserError, match="key 'text'"):
        build_corpus([replace(source, key="text")], tmp_path / "c.jsonl")
    assert not (tmp_path / "c.jsonl").exists()


def test_hub_dataset_without_internet_is_a_user_error(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    # Offline mode as the library sees it (read at import), so the test does not wait on the network.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    source = HfDatasetSource(name="nobody/no-such-dataset-xyz", revision="abc123", split="train")
    with pytest.raises(UserError, match="cannot resolve dataset nobody/no-such-dataset-xyz"):
        build_corpus([source], tmp_path / "x.jsonl")
    with pytest.raises(UserError, match="pin a 'revision'"):
        build_corpus([replace(source, revision=None)], tmp_path / "x.jsonl")


def test_bad_sources_leave_no_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "ok"}) + "\n{oops\n")
    with pytest.raises(UserError, match=r"bad\.jsonl line 2: malformed JSON"):
        build_corpus([JsonlSource(paths=(str(bad),))], tmp_path / "x.jsonl")
    with pytest.raises(UserError, match="matches no file"):
        build_corpus([JsonlSource(paths=(str(tmp_path / "none*.jsonl"),))], tmp_path / "x.jsonl")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps({"content": "ok"}).encode() + b"\n" + b'{"content": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin\.jsonl line 2: not UTF-8 .*re-encode"):
        build_corpus([JsonlSource(paths=(str(latin),))], tmp_path / "x.jsonl")
    fake_gz = tmp_path / "plain.jsonl.gz"
    fake_gz.write_text(json.dumps({"content": "not compressed"}) + "\n")
    with pytest.raises(UserError, match=r"cannot read .*plain\.jsonl\.gz: BadGzipFile"):
        build_corpus([JsonlSource(paths=(str(fake_gz),))], tmp_path / "x.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "latin.jsonl", "plain.jsonl.gz"]


def test_a_moving_revision_is_unpinned_and_the_resolved_commit_is_recorded(tmp_path, monkeypatch):
    """`main` is a branch: `invoke recipes` marks the recipe unpinned and the corpus records the commit
    the branch pointed at. The Hub is out of reach here: its API and loader are stood in for."""
    import datasets

    from megatron_core.config import load_recipe

    recipe = load_recipe("codeparrot-small-1gpu")
    assert recipe.unpinned_revisions() == ["corpus.sources[0].revision=main", "tokenizer.hf_tokenizer_revision=main"]
    sha = "0123456789abcdef0123456789abcdef01234567"
    pinned = load_recipe("codeparrot-small-1gpu", [f"tokenizer.hf_tokenizer_revision={sha}"])
    assert pinned.unpinned_revisions() == ["corpus.sources[0].revision=main"]

    class Info:
        sha = "fedcba9876543210fedcba9876543210fedcba98"

    class Api:
        def dataset_info(self, repo_id, revision):
            assert (repo_id, revision) == ("org/data", "main")
            return Info()

    loaded = {}

    def load_dataset(_name, revision, **_options):  # corpus.py passes split= and streaming= by keyword
        loaded["revision"] = revision
        return [{"content": "def f():\n    return 1\n"}]

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    summary = build_corpus([HfDatasetSource(name="org/data", revision="main")], tmp_path / "c.jsonl")
    assert loaded["revision"] == Info.sha  # the data was read at the resolved commit, not at a moving branch
    assert summary["resolved_revisions"] == {"org/data": Info.sha}


def test_stdlib_corpus_records_and_is_keyed_by_the_python_version(tmp_path, monkeypatch):
    import platform

    from megatron_core.config import load_recipe

    summary = build_corpus([PythonStdlibSource()], tmp_path / "c.jsonl", max_documents=3)
    assert summary["python"] == platform.python_version()
    recipe = load_recipe("codeparrot-tiny")
    here = {stage: recipe.stage_hash(stage) for stage in ("corpus", "tokenizer", "preprocess", "train")}
    monkeypatch.setattr(platform, "python_version", lambda: "3.99.0")
    for stage, value in here.items():
        assert recipe.stage_hash(stage) != value, stage
