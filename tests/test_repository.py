"""The repository stands alone: a clone with nothing beside it has every file its code, tests and
docs use, so no tracked file may point outside the checkout."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The reference shelf beside a developer's checkout, and absolute paths of the machines it was made on.
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(docs|fixtures)\b|/work/(main|shared)\b|[/]root/|/home/\w")


def tracked_text_files():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in names.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.suffix in {".png", ".bin", ".idx"}:
            continue
        try:
            yield name, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def test_no_tracked_file_refers_outside_the_checkout():
    offenders = [
        f"{name}:{number}: {line.strip()}"
        for name, text in tracked_text_files()
        for number, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_the_pattern_catches_what_it_is_for():
    # The examples are put together here so that this file names no outside path itself.
    shelf, docs, fixtures = "/".join(("..", "shared")), "/".join(("shared", "docs")), "/".join(("shared", "fixtures"))
    for bad in (
        f"see {shelf}/docs/x.md",
        f"{fixtures}/megatron-preprocess",
        f"{docs}/x.md",
        "/".join(("", "work", "shared", "x")),
        "/".join(("", "root", ".cache")),
    ):
        assert OUTSIDE.search(bad), bad
    for fine in ("docs/checkpoint-format.md", "tests/fixtures/megatron-preprocess", "./work/codeparrot-tiny"):
        assert not OUTSIDE.search(fine), fine


def test_golden_fixture_is_inside_the_repository():
    fixture = ROOT / "tests" / "fixtures" / "megatron-preprocess"
    for name in (
        "corpus.jsonl",
        "vocab.json",
        "merges.txt",
        "megatron_content_document.bin",
        "megatron_content_document.idx",
        "README.md",
    ):
        assert (fixture / name).is_file(), name


def test_import_layering_contract_is_kept():
    """The layers of docs/architecture.md, as pyproject.toml's import-linter contracts say them."""
    import shutil
    import sys

    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
