"""Run outputs: the Megatron log line, metrics.jsonl, TensorBoard events and the loss curve.

Only the writer rank (global rank 0, or the last pipeline stage's first rank for losses) creates
files; every other rank gets a logger whose methods print nothing and write nothing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_core.files import replace_atomically
from megatron_core.log import get_logger

METRICS_FILENAME = "metrics.jsonl"
LOSS_CURVE_FILENAME = "loss_curve.png"
SUMMARY_FILENAME = "summary.json"
# Only the writer rank logs (RunLogger), so its lines stay bare, as Megatron prints them.
_LOG = get_logger("megatron_core.training.logging", rank_prefix=False)  # by name: also run as __main__


def megatron_train_line(record: Mapping[str, Any], *, train_iters: int) -> str:
    """Megatron's training_log line (docs/metrics-and-flops.md), one line, formatted from the train record
    that metrics.jsonl and TensorBoard get. `lm loss` is left out when no iteration of the interval stepped
    (lm_loss None), as Megatron does; `grad norm` when there is none; then every other key of the record
    that is not None, in the record's order (_OUR_FORMATS: how some of them read)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    lm_loss, grad_norm, tflops = record.get("lm_loss"), record.get("grad_norm"), record["tflops"]
    loss = f" lm loss: {lm_loss:.6E} |" if lm_loss is not None else ""
    norm = f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else ""
    # Megatron's one decimal, but a CPU's few GFLOP/s keep three significant digits instead of reading 0.0
    tflops_text = f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"
    shown = (key for key in record if key not in _MEGATRON_KEYS and key not in _LINE_HIDDEN)
    extra = "".join(_our_field(key, record[key]) for key in shown if record[key] is not None)
    return (
        f" [{stamp}] iteration {record['iteration']:8d}/{train_iters:8d} | consumed samples:"
        f" {record['consumed_samples']:12d} | elapsed time per iteration (ms): {record['elapsed_ms']:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {tflops_text} | learning rate: {record['lr']:.6E} |"
        f" global batch size: {record['global_batch_size']:5d} |{loss} loss scale: {record['loss_scale']:.1f} |"
        f"{norm} number of skipped iterations: {record['skipped']:3d} |"
        f" number of nan iterations: {record['nan']:3d} |{extra}"
    )


# The record's keys Megatron's own part of the line shows (above, in its format).
_MEGATRON_KEYS = frozenset(
    {
        "iteration",
        "consumed_samples",
        "elapsed_ms",
        "tflops",
        "lr",
        "global_batch_size",
        "lm_loss",
        "loss_scale",
        "grad_norm",
        "skipped",
        "nan",
    }
)
# How some of our keys read on the line; _LINE_HIDDEN: metrics.jsonl and TensorBoard only. Any other key the
# trainer puts in its record shows as "name: value": a new metric is one entry in the record and reaches every sink.
_OUR_FORMATS = {
    "tokens_per_s": " tokens/s: {:.0f} |",
    "batch_generator_ms": " batch-generator: {:.1f} ms |",
    "mfu": " MFU: {:.1%} |",
}
_LINE_HIDDEN = frozenset({"batch_generator_share"})


def _our_field(key: str, value: Any) -> str:
    text = _OUR_FORMATS.get(key)
    if text is not None:
        return text.format(value)
    shown = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f" {key.replace('_', ' ')}: {shown} |"


def megatron_eval_line(kind: str, iteration: int, loss: float, ppl: float) -> str:
    label = "validation" if kind == "valid" else "test"
    return f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"


def perplexity(loss: float) -> float:
    """Megatron caps the exponent at 20; a NaN/inf loss has no perplexity (NaN), never the cap's."""
    return math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")


def finite_or_none(value):
    """A float that JSON can hold: NaN and +-inf become None (null)."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


def strict_json(record: dict) -> str:
    """One JSON object that strict parsers accept: non-finite floats (top level and nested) as null."""

    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return finite_or_none(value)

    return json.dumps(clean(record), allow_nan=False)


class RunLogger:
    def __init__(self, run_dir: Path, *, writer: bool, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.writer = writer
        self.metrics_path = self.run_dir / METRICS_FILENAME
        self._tb = None
        if writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def info(self, message: str) -> None:
        if self.writer:
            _LOG.info(message)

    def truncate_after(self, iteration: int) -> None:
        """On resume: drop metrics of iterations after the checkpoint (they are trained again)."""
        if not self.writer or not self.metrics_path.exists():
            return
        kept = [
            line
            for line in self.metrics_path.read_text().splitlines()
            if line.strip() and json.loads(line)["iteration"] <= iteration
        ]
        replace_atomically(self.metrics_path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))

    def _append(self, record: dict) -> None:
        with open(self.metrics_path, "a") as handle:
            handle.write(strict_json(record) + "\n")

    def train(self, record: dict, *, train_iters: int) -> None:
        """One train record to every sink: the Megatron line, metrics.jsonl, TensorBoard."""
        if not self.writer:
            return
        _LOG.info(megatron_train_line(record, train_iters=train_iters))
        self._append({"type": "train", **record})
        self._scalars("train", record)

    def _scalars(self, kind: str, record: Mapping[str, Any]) -> None:
        """Every numeric value of the record as TensorBoard tag `kind/key` at its iteration (no allow-list:
        a new key shows up by itself); None and NaN/inf are no point to draw and are left out."""
        if self._tb is None:
            return
        for key, value in record.items():
            if key in ("type", "iteration") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if finite_or_none(float(value)) is not None:
                self._tb.add_scalar(f"{kind}/{key}", value, record["iteration"])
        self._tb.flush()

    def evaluation(self, kind: str, iteration: int, loss: float) -> dict:
        """The eval line (a NaN loss prints as nan, with a nan PPL) and its record (null for non-finite)."""
        ppl = perplexity(loss)
        record = {"type": kind, "iteration": iteration, "lm_loss": finite_or_none(loss), "ppl": finite_or_none(ppl)}
        if self.writer:
            bar = "-" * 100
            _LOG.info(f"{bar}\n{megatron_eval_line(kind, iteration, loss, ppl)}\n{bar}")
            self._append(record)
            self._scalars(kind, record)
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def write_summary(run_dir: Path, summary: dict) -> Path:
    """RUN_DIR/summary.json (strict JSON, atomically): what `summary:` prints at the end of a run."""
    path = Path(run_dir) / SUMMARY_FILENAME
    replace_atomically(path, lambda tmp: tmp.write_text(strict_json(summary) + "\n"))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILENAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_loss_curve(run_dir: Path, title: str = "") -> Optional[Path]:
    """loss_curve.png from metrics.jsonl (train and valid lm loss against iteration)."""
    records = read_metrics(run_dir)
    # null: no iteration of that interval stepped (or a non-finite evaluation): no point to draw
    train = [(r["iteration"], r["lm_loss"]) for r in records if r["type"] == "train" and r["lm_loss"] is not None]
    valid = [(r["iteration"], r["lm_loss"]) for r in records if r["type"] == "valid" and r["lm_loss"] is not None]
    if not train and not valid:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train lm loss")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(run_dir) / LOSS_CURVE_FILENAME
    replace_atomically(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return path


if __name__ == "__main__":  # python -m megatron_core.training.logging RUN_DIR: redraw the curve on request
    if len(sys.argv) != 2:
        sys.exit("usage: python -m megatron_core.training.logging RUN_DIR")
    print(write_loss_curve(Path(sys.argv[1])))
