"""Golden loss values for the CI smoke recipes (Megatron's functional-test pattern).

`ci/golden/<recipe>.json` holds the lm_loss of every logged train iteration and every evaluation of one
reference run, the recipe hash it was made with and the tolerance it is checked with. A fresh run's
`metrics.jsonl` (docs/metrics-and-flops.md) is compared value by value; a drift, a missing or an extra iteration
fails with a diff table. `update` rewrites the file from a run (after an intended change).

Tolerance: a value passes when |actual - golden| <= atol + rtol * |golden|. The defaults (rtol 1e-4,
atol 1e-6) are for fp32 runs on a CPU torch build: on one machine the smoke losses repeat exactly with the
same thread count and to ~4e-8 relative between 1 and 2 threads (measured), and other x86 machines reorder
float sums through other SIMD paths, so 1e-4 leaves that noise ~1000x room while a wrong learning rate,
mask or data order moves the loss by 1e-3 or more. Looser across torch versions or CPU families: pass
--rtol. A GPU run is not compared with these CPU values at all: `sanity` checks it (finite losses that
go down, no NaN-guard iteration; fp16's skipped iterations are counted, not judged) instead.

    python -m ci.golden check  --recipe smoke [--workdir W | --metrics run/metrics.jsonl]
    python -m ci.golden update --recipe smoke [--workdir W | --metrics run/metrics.jsonl]
    python -m ci.golden sanity --metrics run/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_core.errors import UserError

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
METRIC = "lm_loss"
SPLITS = ("train", "valid", "test")
DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6

Values = dict[str, dict[int, float]]  # split -> iteration -> lm_loss


class GoldenError(UserError):
    """Golden files or metrics that cannot be read or do not match."""


# ----------------------------------------------------------------------------------------------
# Reading a run and a golden file
# ----------------------------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> Values:
    """lm_loss per split and iteration from a run's metrics.jsonl; the last record wins for a repeated
    (split, iteration), as after a resumed run."""
    path = Path(path)
    if not path.is_file():
        raise GoldenError(
            f"no metrics file at {path}; run the recipe first (invoke train --recipe ...) "
            "or pass --metrics <run dir>/metrics.jsonl"
        )
    values: Values = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GoldenError(f"{path} line {number}: not JSON ({exc.msg}); the run wrote a broken line") from None
        split = record.get("type")
        if split not in SPLITS:
            continue
        if "iteration" not in record or METRIC not in record:
            raise GoldenError(f"{path} line {number}: a {split} record without 'iteration' or '{METRIC}'")
        loss = record[METRIC]
        values.setdefault(split, {})[int(record["iteration"])] = float("nan") if loss is None else float(loss)
    if not values.get("train"):
        raise GoldenError(
            f"{path} has no train records with {METRIC}; did the run log anything (log_interval <= train_iters)?"
        )
    return values


@dataclass
class Golden:
    recipe: str
    recipe_hash: str | None
    values: Values
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    environment: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "recipe_hash": self.recipe_hash,
            "metric": METRIC,
            "tolerance": {"rtol": self.rtol, "atol": self.atol, "rule": "|actual - golden| <= atol + rtol * |golden|"},
            "environment": self.environment,
            **{
                split: {str(it): v for it, v in sorted(self.values[split].items())}
                for split in SPLITS
                if split in self.values
            },
        }

    @classmethod
    def from_json(cls, data: dict, where: str) -> "Golden":
        try:
            values = {split: {int(it): float(v) for it, v in data[split].items()} for split in SPLITS if split in data}
            tolerance = data["tolerance"]
            return cls(
                recipe=data["recipe"],
                recipe_hash=data.get("recipe_hash"),
                values=values,
                rtol=float(tolerance["rtol"]),
                atol=float(tolerance["atol"]),
                environment=data.get("environment", {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GoldenError(
                f"{where} is not a golden file ({type(exc).__name__}: {exc}); regenerate it with "
                "`python -m ci.golden update`"
            ) from None


def golden_path(recipe: str, golden_dir: str | os.PathLike = GOLDEN_DIR) -> Path:
    return Path(golden_dir) / f"{recipe}.json"


def load_golden(recipe: str, golden_dir: str | os.PathLike = GOLDEN_DIR) -> Golden:
    path = golden_path(recipe, golden_dir)
    if not path.is_file():
        known = ", ".join(golden_recipes(golden_dir)) or "none"
        raise GoldenError(
            f"no golden file {path} (golden recipes: {known}); create it with "
            f"`python -m ci.golden update --recipe {recipe}`"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GoldenError(f"{path}: not JSON ({exc.msg}); regenerate it with `python -m ci.golden update`") from None
    return Golden.from_json(data, str(path))


def golden_recipes(golden_dir: str | os.PathLike = GOLDEN_DIR) -> list[str]:
    return sorted(p.stem for p in Path(golden_dir).glob("*.json"))


def write_golden(golden: Golden, golden_dir: str | os.PathLike = GOLDEN_DIR) -> Path:
    """Write atomically (temp name, then rename) so a failed update never leaves half a golden file."""
    path = golden_path(golden.recipe, golden_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(golden.to_json(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def environment() -> dict:
    """Where a golden run was made: worth knowing when a value drifts on another machine."""
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    split: str
    iteration: int
    golden: float | None
    actual: float | None
    status: str  # ok | DRIFT | MISSING (golden has it, the run not) | EXTRA (the run has it, golden not)

    @property
    def abs_diff(self) -> float | None:
        if self.golden is None or self.actual is None:
            return None
        return abs(self.actual - self.golden)

    @property
    def rel_diff(self) -> float | None:
        diff = self.abs_diff
        if diff is None or self.golden == 0:
            return None
        return diff / abs(self.golden)


@dataclass(frozen=True)
class Comparison:
    recipe: str
    rows: tuple[Row, ...]
    rtol: float
    atol: float
    hash_note: str = ""  # set when the run's recipe hash differs from the golden's

    @property
    def failures(self) -> list[Row]:
        return [row for row in self.rows if row.status != "ok"]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.hash_note

    def table(self, only_failures: bool = False) -> str:
        def fmt(value, spec):
            return "-" if value is None else format(value, spec)

        header = ("split", "iteration", "golden", "actual", "abs diff", "rel diff", "status")
        lines = [header] + [
            (
                row.split,
                str(row.iteration),
                fmt(row.golden, ".6f"),
                fmt(row.actual, ".6f"),
                fmt(row.abs_diff, ".2e"),
                fmt(row.rel_diff, ".2e"),
                row.status,
            )
            for row in self.rows
            if not only_failures or row.status != "ok"
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)

    def summary(self) -> str:
        counted = (
            f"{len(self.rows) - len(self.failures)}/{len(self.rows)} values within rtol={self.rtol:g} "
            f"atol={self.atol:g}"
        )
        text = f"golden {self.recipe}: {counted}"
        return text + (f"; {self.hash_note}" if self.hash_note else "")


def within(actual: float, golden: float, rtol: float, atol: float) -> bool:
    return math.isfinite(actual) and abs(actual - golden) <= atol + rtol * abs(golden)


def compare(
    golden: Golden, values: Values, rtol: float | None = None, atol: float | None = None, recipe_hash: str | None = None
) -> Comparison:
    """Every golden value against the run's, plus the run's values the golden does not have."""
    rtol = golden.rtol if rtol is None else rtol
    atol = golden.atol if atol is None else atol
    rows = []
    for split in SPLITS:
        want, got = golden.values.get(split, {}), values.get(split, {})
        for iteration in sorted(set(want) | set(got)):
            g, a = want.get(iteration), got.get(iteration)
            if g is None:
                status = "EXTRA"
            elif a is None:
                status = "MISSING"
            else:
                status = "ok" if within(a, g, rtol, atol) else "DRIFT"
            rows.append(Row(split, iteration, g, a, status))
    note = ""
    if recipe_hash and golden.recipe_hash and recipe_hash != golden.recipe_hash:
        note = (
            f"the recipe changed since the golden was made (hash {recipe_hash}, golden {golden.recipe_hash}); "
            f"if the change is intended, regenerate with `python -m ci.golden update --recipe {golden.recipe}`"
        )
    return Comparison(golden.recipe, tuple(rows), rtol, atol, note)


def check(
    recipe: str,
    metrics: str | os.PathLike,
    golden_dir: str | os.PathLike = GOLDEN_DIR,
    rtol: float | None = None,
    atol: float | None = None,
    recipe_hash: str | None = None,
) -> Comparison:
    """Compare a run with its golden file; raises GoldenError with the diff table when they disagree."""
    comparison = compare(load_golden(recipe, golden_dir), read_metrics(metrics), rtol, atol, recipe_hash)
    if not comparison.ok:
        raise GoldenError(
            f"{comparison.summary()}; the run's metrics: {metrics}\n{comparison.table()}\n"
            f"if the change is intended, regenerate with `python -m ci.golden update --recipe {recipe}`"
        )
    return comparison


def update(
    recipe: str,
    metrics: str | os.PathLike,
    golden_dir: str | os.PathLike = GOLDEN_DIR,
    recipe_hash: str | None = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
) -> Path:
    """Rewrite ci/golden/<recipe>.json from a run; refuses a run with a non-finite loss."""
    values = read_metrics(metrics)
    bad = [(split, it) for split, by_it in values.items() for it, v in by_it.items() if not math.isfinite(v)]
    if bad:
        raise GoldenError(
            f"{metrics} has non-finite {METRIC} at {bad[:5]}; a golden file must come from a "
            "healthy run: fix the run first"
        )
    return write_golden(Golden(recipe, recipe_hash, values, rtol, atol, environment()), golden_dir)


def sanity(metrics: str | os.PathLike) -> str:
    """Device-independent checks for runs with no golden (a GPU smoke): the losses of the iterations that
    stepped are finite and go down, and no iteration was caught by the NaN guard (`nan`). Iterations an
    fp16 loss scaler skipped while it found its scale are counted in `skipped` and have no loss; a train
    record whose whole interval was skipped holds lm_loss null and is left out, not judged as NaN."""
    path = Path(metrics)
    values = read_metrics(path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train_records = [r for r in records if r.get("type") == "train"]
    flagged = [r["iteration"] for r in train_records if r.get("nan")]
    all_skipped = {r["iteration"] for r in train_records if r.get(METRIC) is None and r.get("skipped")}
    bad = [
        (s, it)
        for s, by_it in values.items()
        for it, v in by_it.items()
        if not math.isfinite(v) and not (s == "train" and it in all_skipped)
    ]
    train = [v for it, v in sorted(values["train"].items()) if it not in all_skipped]
    skipped = sum(int(r.get("skipped") or 0) for r in train_records)
    problems = []
    if bad or flagged:
        problems.append(f"non-finite {METRIC} at {(bad + flagged)[:5]}")
    if len(train) < 2:
        problems.append(f"fewer than two logged train iterations that stepped ({skipped} skipped)")
    elif not train[-1] < train[0]:
        problems.append(f"train {METRIC} did not go down ({train[0]:.4f} -> {train[-1]:.4f})")
    if problems:
        raise GoldenError(f"{path}: " + "; ".join(problems))
    note = f"; {skipped} iterations skipped (fp16 loss scaling)" if skipped else ""
    return f"sane: {len(train)} train values, {METRIC} {train[0]:.4f} -> {train[-1]:.4f}{note}"


# ----------------------------------------------------------------------------------------------
# Finding a recipe's run, and the one-call entry point for `invoke ci.golden`
# ----------------------------------------------------------------------------------------------


def run_metrics(recipe: str, workdir: str | os.PathLike, overrides=()) -> tuple[Path, str]:
    """(metrics.jsonl of the recipe's run in `workdir`, the hash of what its losses depend on)."""
    from megatron_core import config, workflow

    from megatron_core.config.hashing import losses_hash

    resolved = config.load_recipe(recipe, list(overrides or []))
    return workflow.run_dir(resolved, workdir) / "metrics.jsonl", losses_hash(resolved.to_dict())


def run(
    recipe: str,
    workdir: str | os.PathLike = "./work",
    update_golden: bool = False,
    metrics=None,
    overrides=(),
    golden_dir: str | os.PathLike = GOLDEN_DIR,
    rtol: float | None = None,
    atol: float | None = None,
    echo=print,
) -> Comparison | Path:
    """Check (or with update_golden, regenerate) one recipe's golden file from its run in `workdir`."""
    path, recipe_hash = run_metrics(recipe, workdir, overrides)
    path = Path(metrics) if metrics else path
    if update_golden:
        written = update(
            recipe,
            path,
            golden_dir,
            recipe_hash,
            DEFAULT_RTOL if rtol is None else rtol,
            DEFAULT_ATOL if atol is None else atol,
        )
        echo(f"wrote {written} from {path}")
        return written
    comparison = check(recipe, path, golden_dir, rtol, atol, recipe_hash)
    echo(comparison.summary())
    echo(comparison.table())
    return comparison


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.golden", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("check", "update", "sanity"))
    parser.add_argument("--recipe", help="recipe name (its golden file is ci/golden/<recipe>.json)")
    parser.add_argument("--workdir", default="./work", help="where the recipe's run is (default ./work)")
    parser.add_argument("--metrics", help="a metrics.jsonl to use instead of the recipe's run in --workdir")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    parser.add_argument("--golden-dir", default=str(GOLDEN_DIR))
    parser.add_argument("--rtol", type=float)
    parser.add_argument("--atol", type=float)
    args = parser.parse_args(argv)
    try:
        if args.action == "sanity":
            if not args.metrics and not args.recipe:
                raise GoldenError("sanity needs --metrics <run dir>/metrics.jsonl or --recipe")
            print(sanity(args.metrics or run_metrics(args.recipe, args.workdir, args.overrides)[0]))
            return 0
        if not args.recipe:
            raise GoldenError(f"{args.action} needs --recipe (golden recipes: {', '.join(golden_recipes())})")
        run(
            args.recipe,
            args.workdir,
            args.action == "update",
            args.metrics,
            args.overrides,
            args.golden_dir,
            args.rtol,
            args.atol,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
