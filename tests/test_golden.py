"""ci/golden.py: compare a run's metrics.jsonl with ci/golden/<recipe>.json, fail with a diff table, update."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # ci/ is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(ROOT))

from ci import golden  # noqa: E402  (after the sys.path line above)

TRAIN = {2: 6.2400, 4: 6.1000, 6: 5.8000, 8: 5.5000}
VALID = {8: 5.6000}


def write_metrics(path: Path, train=TRAIN, valid=VALID, extra_lines=()) -> Path:
    lines = []
    for it, loss in train.items():
        lines.append(
            {
                "type": "train",
                "iteration": it,
                "consumed_samples": it * 8,
                "lm_loss": loss,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "loss_scale": 1.0,
                "elapsed_ms": 5.0,
                "tokens_per_s": 1.0,
                "tflops": 0.0,
                "skipped": 0,
                "nan": 0,
            }
        )
    for it, loss in valid.items():
        lines.append({"type": "valid", "iteration": it, "lm_loss": loss, "ppl": math.exp(loss)})
    path.write_text("\n".join([json.dumps(x) for x in lines] + list(extra_lines)) + "\n")
    return path


@pytest.fixture
def made(tmp_path):
    """A golden file made from a synthetic run, and that run's metrics."""
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    gdir = tmp_path / "golden"
    golden.update("smoke", metrics, gdir, recipe_hash="abc123")
    return gdir, metrics


def test_update_writes_every_value_and_the_tolerance(made):
    gdir, _ = made
    data = json.loads((gdir / "smoke.json").read_text())
    assert data["train"] == {str(k): v for k, v in TRAIN.items()} and data["valid"] == {"8": 5.6}
    assert data["tolerance"]["rtol"] == golden.DEFAULT_RTOL and data["tolerance"]["atol"] == golden.DEFAULT_ATOL
    assert data["recipe_hash"] == "abc123" and "torch" in data["environment"]
    assert not list(gdir.glob(".*tmp*"))  # atomic: no temp file left


def test_same_run_passes(made):
    gdir, metrics = made
    comparison = golden.check("smoke", metrics, gdir, recipe_hash="abc123")
    assert comparison.ok and len(comparison.rows) == 5
    assert comparison.summary() == "golden smoke: 5/5 values within rtol=0.0001 atol=1e-06"


def test_drift_within_tolerance_passes_beyond_fails_with_table(made, tmp_path):
    gdir, _ = made
    inside = write_metrics(tmp_path / "inside.jsonl", train={**TRAIN, 6: 5.8 * (1 + 5e-5)})
    assert golden.check("smoke", inside, gdir).ok
    outside = write_metrics(tmp_path / "outside.jsonl", train={**TRAIN, 6: 5.8 * (1 + 5e-3)})
    with pytest.raises(golden.GoldenError) as info:
        golden.check("smoke", outside, gdir)
    message = str(info.value)
    assert message.startswith("golden smoke: 4/5 values within rtol=0.0001 atol=1e-06")
    table = message.splitlines()
    assert table[1].split() == ["split", "iteration", "golden", "actual", "abs", "diff", "rel", "diff", "status"]
    drift = [line.split() for line in table if line.endswith("DRIFT")]
    assert drift == [["train", "6", "5.800000", "5.829000", "2.90e-02", "5.00e-03", "DRIFT"]]
    # an explicit, looser tolerance lets it through
    assert golden.check("smoke", outside, gdir, rtol=1e-2).ok


def test_missing_extra_and_nan_values_fail(made, tmp_path):
    gdir, _ = made
    changed = write_metrics(tmp_path / "m.jsonl", train={2: 6.24, 4: float("nan"), 6: 5.8, 10: 5.0}, valid={})
    comparison = golden.compare(golden.load_golden("smoke", gdir), golden.read_metrics(changed))
    status = {(row.split, row.iteration): row.status for row in comparison.rows}
    assert status == {
        ("train", 2): "ok",
        ("train", 4): "DRIFT",
        ("train", 6): "ok",
        ("train", 8): "MISSING",
        ("train", 10): "EXTRA",
        ("valid", 8): "MISSING",
    }
    assert not comparison.ok


def test_changed_recipe_is_reported(made):
    gdir, metrics = made
    with pytest.raises(
        golden.GoldenError,
        match="the recipe changed since the golden was made "
        r"\(hash def456, golden abc123\)",
    ):
        golden.check("smoke", metrics, gdir, recipe_hash="def456")


def test_update_refuses_a_run_with_nan(tmp_path):
    metrics = write_metrics(tmp_path / "m.jsonl", train={2: 6.0, 4: float("nan")})
    with pytest.raises(golden.GoldenError, match="non-finite lm_loss"):
        golden.update("smoke", metrics, tmp_path / "g")
    assert not (tmp_path / "g" / "smoke.json").exists()


def test_read_metrics_errors(tmp_path):
    with pytest.raises(golden.GoldenError, match="no metrics file at"):
        golden.read_metrics(tmp_path / "absent.jsonl")
    broken = write_metrics(tmp_path / "b.jsonl", extra_lines=['{"type": "train", "iter'])
    with pytest.raises(golden.GoldenError, match=r"b.jsonl line 6: not JSON"):
        golden.read_metrics(broken)
    empty = write_metrics(tmp_path / "e.jsonl", train={})
    with pytest.raises(golden.GoldenError, match="has no train records"):
        golden.read_metrics(empty)


def test_missing_or_broken_golden_file(tmp_path):
    with pytest.raises(golden.GoldenError, match="no golden file .*smoke.json"):
        golden.load_golden("smoke", tmp_path)
    (tmp_path / "smoke.json").write_text('{"recipe": "smoke"}')
    with pytest.raises(golden.GoldenError, match="is not a golden file"):
        golden.load_golden("smoke", tmp_path)


def test_sanity_for_runs_without_golden(tmp_path):
    assert golden.sanity(write_metrics(tmp_path / "ok.jsonl")) == "sane: 4 train values, lm_loss 6.2400 -> 5.5000"
    with pytest.raises(golden.GoldenError, match="did not go down"):
        golden.sanity(write_metrics(tmp_path / "up.jsonl", train={2: 5.0, 4: 6.0}))
    with pytest.raises(golden.GoldenError, match="non-finite"):
        golden.sanity(write_metrics(tmp_path / "nan.jsonl", train={2: 6.0, 4: float("inf")}))


def test_cli_check_fails_with_table_and_update_round_trips(made, tmp_path, capsys):
    gdir, _ = made
    drifted = write_metrics(tmp_path / "d.jsonl", train={**TRAIN, 8: 4.0})
    assert golden.main(["check", "--recipe", "smoke", "--metrics", str(drifted), "--golden-dir", str(gdir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: golden smoke: 4/5 values") and "DRIFT" in err
    assert golden.main(["update", "--recipe", "smoke", "--metrics", str(drifted), "--golden-dir", str(gdir)]) == 0
    assert golden.main(["check", "--recipe", "smoke", "--metrics", str(drifted), "--golden-dir", str(gdir)]) == 0
    assert "golden smoke: 5/5 values" in capsys.readouterr().out


def test_committed_golden_files_are_valid():
    for recipe in golden.golden_recipes():
        g = golden.load_golden(recipe)
        assert g.recipe == recipe and g.values["train"], recipe
        assert all(math.isfinite(v) for by_it in g.values.values() for v in by_it.values())


def test_tp2pp2_golden_equals_the_single_process_golden():
    """smoke-tp2pp2 is the smoke recipe split TP 2 x PP 2: from the same initial weights (layout-independent
    init) its losses are the single process's, number for number."""
    single, split = golden.load_golden("smoke"), golden.load_golden("smoke-tp2pp2")
    assert single.values.keys() == split.values.keys()
    for kind, by_it in single.values.items():
        assert by_it.keys() == split.values[kind].keys()
        for it, value in by_it.items():
            assert split.values[kind][it] == pytest.approx(value, rel=1e-5), f"{kind} iteration {it}"


# ----------------------------------------------------------------------------------------------
# ci/hf_load.py: the smoke job's "transformers loads the converted model" step
# ----------------------------------------------------------------------------------------------


def test_hf_load_checks_shape_loss_and_generation(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ci import hf_load

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=128)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    expect = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64}
    result = hf_load.check_hf_model(tmp_path, expect)
    assert math.isfinite(result["loss"]) and len(result["generated_ids"]) == 8
    with pytest.raises(golden.UserError, match=r"does not match the recipe: n_layer=2 \(recipe: 12\)"):
        hf_load.check_hf_model(tmp_path, {**expect, "n_layer": 12})
    with pytest.raises(golden.UserError, match="has no config.json"):
        hf_load.check_hf_model(tmp_path / "absent")


def test_sanity_judges_the_iterations_that_stepped_and_counts_fp16_skips(tmp_path):
    """An fp16 run's first intervals, all skipped by the loss scaler, log lm_loss null: sanity leaves them out
    and reports the skips; a NaN-guard iteration (`nan`) or a null loss in an interval that skipped nothing
    still fails."""

    def record(it, loss, skipped=0, nan=0):
        return json.dumps({"type": "train", "iteration": it, "lm_loss": loss, "skipped": skipped, "nan": nan})

    skipped = [record(2, None, skipped=2), record(4, None, skipped=2)]
    path = write_metrics(tmp_path / "fp16.jsonl", train={6: 6.0, 8: 5.5}, extra_lines=skipped)
    assert golden.sanity(path) == (
        "sane: 2 train values, lm_loss 6.0000 -> 5.5000; 4 iterations skipped (fp16 loss scaling)"
    )
    flagged = write_metrics(tmp_path / "nan.jsonl", train={6: 6.0, 8: 5.5}, extra_lines=[record(4, None, 1, 1)])
    with pytest.raises(golden.GoldenError, match="non-finite"):
        golden.sanity(flagged)
    silent = write_metrics(tmp_path / "null.jsonl", train={6: 6.0, 8: 5.5}, extra_lines=[record(4, None)])
    with pytest.raises(golden.GoldenError, match=r"non-finite lm_loss at \[\('train', 4\)\]"):
        golden.sanity(silent)
    only_skips = write_metrics(tmp_path / "short.jsonl", train={6: 6.0}, extra_lines=skipped)
    with pytest.raises(golden.GoldenError, match=r"fewer than two logged train iterations that stepped \(4 skipped\)"):
        golden.sanity(only_skips)
