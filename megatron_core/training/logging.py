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
from typing import Optional

from megatron_core.files import replace_atomically

METRICS_FILENAME = "metrics.jsonl"
LOSS_CURVE_FILENAME = "loss_curve.png"
SUMMARY_FILENAME = "summary.json"


def log(message: str) -> None:
    print(message, flush=True)


def megatron_train_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                        tflops: float, lr: float, global_batch_size: int, lm_loss: Optional[float], loss_scale: float,
                        grad_norm: Optional[float], skipped: int, nan: int, extra: str = "") -> str:
    """Megatron's training_log line (docs/metrics-and-flops.md), one line. `lm loss` is left out when no
    iteration of the interval stepped (lm_loss None), as Megatron does; `grad norm` when there is none."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    loss = f" lm loss: {lm_loss:.6E} |" if lm_loss is not None else ""
    norm = f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else ""
    # Megatron's one decimal, but a CPU's few GFLOP/s keep three significant digits instead of reading 0.0
    tflops_text = f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"
    return (f" [{stamp}] iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {elapsed_ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tflops_text} |"
            f" learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} |{loss}"
            f" loss scale: {loss_scale:.1f} |{norm} number of skipped iterations: {skipped:3d} |"
            f" number of nan iterations: {nan:3d} |{extra}")


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
            log(message)

    def truncate_after(self, iteration: int) -> None:
        """On resume: drop metrics of iterations after the checkpoint (they are trained again)."""
        if not self.writer or not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line)["iteration"] <= iteration]
        replace_atomically(self.metrics_path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))

    def _append(self, record: dict) -> None:
        with open(self.metrics_path, "a") as handle:
            handle.write(strict_json(record) + "\n")

    def train(self, record: dict, line: str) -> None:
        if not self.writer:
            return
        log(line)
        self._append({"type": "train", **record})
        if self._tb is not None:
            it = record["iteration"]
            for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "tflops", "mfu"):
                if finite_or_none(record.get(key)) is not None:
                    self._tb.add_scalar(f"train/{key}", record[key], it)
            self._tb.flush()

    def evaluation(self, kind: str, iteration: int, loss: float) -> dict:
        """The eval line (a NaN loss prints as nan, with a nan PPL) and its record (null for non-finite)."""
        ppl = perplexity(loss)
        record = {"type": kind, "iteration": iteration, "lm_loss": finite_or_none(loss), "ppl": finite_or_none(ppl)}
        if self.writer:
            bar = "-" * 100
            log(f"{bar}\n{megatron_eval_line(kind, iteration, loss, ppl)}\n{bar}")
            self._append(record)
            if self._tb is not None and record["lm_loss"] is not None:
                self._tb.add_scalar(f"{kind}/lm_loss", loss, iteration)
                self._tb.add_scalar(f"{kind}/ppl", ppl, iteration)
                self._tb.flush()
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
