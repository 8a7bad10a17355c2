"""bench.eval: both sides generate the same number of tokens from the same converted model (greedy
agrees first), the JSON has the promised keys and is the last line of the output; bad flags are refused."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_eval_writes_the_ratio_and_refuses_bad_flags(tmp_path):
    common = [sys.executable, "-m", "bench.eval", "--results-dir", str(tmp_path)]
    ok = subprocess.run(
        common
        + [
            "--problems",
            "1",
            "--samples",
            "2",
            "--batch",
            "2",
            "--max-new-tokens",
            "6",
            "--repeats",
            "1",
            "--vocab-size",
            "512",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    result = json.loads(ok.stdout.strip().splitlines()[-1])
    greedy = result["greedy_check"]
    assert len(greedy["ours"]) == 6 and greedy["ours"] == greedy["transformers"]
    assert [r["new_tokens"] for r in result["ours_runs"]] == [r["new_tokens"] for r in result["baseline_runs"]] == [12]
    assert result["ratio"] > 0 and result["ours_tokens_per_s"] > 0 and result["baseline_tokens_per_s"] > 0
    assert result["model"]["num_layers"] == 6 and result["model"]["hidden_size"] == 256 and result["threads"] == 1
    written = json.loads(Path(result["results_file"]).read_text())
    assert written == {k: v for k, v in result.items() if k != "results_file"}
    assert Path(result["results_file"]).parent == tmp_path
    bad = subprocess.run(
        common + ["--samples", "6", "--batch", "4"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: need --problems")
    assert "--samples a multiple" in bad.stderr
