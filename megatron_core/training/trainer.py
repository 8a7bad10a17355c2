"""The training loop: iterations of forward/backward over micro batches, optimizer step, LR step,
logging, evaluation and checkpoints, in the order Megatron runs them.

    Trainer(recipe, model, datasets, padded_vocab_size, run_dir, ...).fit() -> summary dict

Everything the loop needs is built by megatron_core.pretrain_gpt (or handed in by a test); the loop
itself knows nothing about files on disk except the run directory and the checkpoint folder.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_core import checkpoint_format
from megatron_core import parallel_state as ps
from megatron_core.distributed import TrainableModel
from megatron_core.errors import UserError
from megatron_core.training import checkpointing as ckpt
from megatron_core.training import flops as flops_lib
from megatron_core.training.data_iterators import batch_iterator
from megatron_core.training.logging import (
    RunLogger,
    finite_or_none,
    strict_json,
    write_loss_curve,
    write_summary,
)
from megatron_core.training.lr_schedule import OptimizerParamScheduler


def masked_loss_func(loss_mask: torch.Tensor):
    """Megatron's loss: mean per-token loss over the unmasked tokens of the micro batch."""
    mask = loss_mask.float()

    def loss_func(per_token_loss: torch.Tensor):
        loss = (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1.0)
        return loss, {"lm loss": loss.detach()}

    return loss_func


def gpt_forward_step(data_iterator, model):
    """forward_step_func of the schedule contract for GPT: one micro batch -> (per-token loss, loss_func)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return output, masked_loss_func(batch["loss_mask"])


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0  # every iteration whose update was skipped (fp16 overflow or the NaN guard)
    nan_iterations: int = 0  # those skipped by the NaN guard: a non-finite loss or grad norm
    consecutive_nan: int = 0  # NaN-guard skips in a row (training.max_consecutive_nan_steps stops the run)
    # Since the last log line (Megatron averages the loss over the log interval).
    interval_start: float = 0.0
    interval_iterations: int = 0


STOP_CHECK_INTERVAL = 10  # iterations between the ranks' agreement on a received SIGINT/SIGTERM


class NonFiniteTrainingError(UserError):
    """The run diverged: too many NaN/inf iterations in a row, or non-finite weights at a save."""


class Trainer:
    def __init__(
        self,
        recipe,
        model: TrainableModel,
        datasets,
        padded_vocab_size: int,
        run_dir: Path,
        *,
        optimizer,
        device: torch.device,
        save: Optional[Path],
        load: Optional[Path],
        save_optim: bool = True,
        params_dtype: str = "float32",
        logger: Optional[RunLogger] = None,
        forward_backward_func=None,
        device_name: str = "cpu",
        precision: str = "fp32",
        tokenizer_files=None,
        resume_fallback: bool = True,
        from_scratch: bool = False,
    ) -> None:
        from megatron_core.pipeline_parallel import get_forward_backward_func

        self.recipe, self.model, self.device = recipe, model, device
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.padded_vocab_size = padded_vocab_size
        self.run_dir = Path(run_dir)
        self.optimizer = optimizer
        self.save_dir, self.load_dir = (Path(save) if save else None), (Path(load) if load else None)
        self.save_optim, self.params_dtype, self.precision = save_optim, params_dtype, precision
        self.tokenizer_files = tokenizer_files  # (vocab, merges) copied into every checkpoint directory
        # --no-fallback / --from-scratch (checkpointing.load_latest)
        self.resume_fallback, self.from_scratch = resume_fallback, from_scratch
        self.logger = logger or RunLogger(self.run_dir, writer=_is_log_writer())
        self.forward_backward = forward_backward_func or get_forward_backward_func()
        t = recipe.training
        self.scheduler = OptimizerParamScheduler.for_training(optimizer, t)
        self.state = TrainState()
        self.num_micro_batches = recipe.num_micro_batches
        m = recipe.model
        self.flops_per_iteration = flops_lib.model_flops_per_iteration(
            global_batch_size=t.global_batch_size,
            seq_length=m.seq_length,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.ffn_size,
            padded_vocab_size=padded_vocab_size,
            full_recompute=recipe.parallel.recompute_granularity == "full",
        )
        self.peak_tflops = flops_lib.device_peak_tflops(device_name, precision) if device.type == "cuda" else None
        self._stop_signal: Optional[int] = None

    # -- resume --------------------------------------------------------------------------------
    def maybe_resume(self) -> None:
        """Continue from the checkpoint under --load, if any: the policy (fallback, reshard, vocabulary,
        optimizer state, weights-only starts) is checkpointing.restore's; the loop takes the counters."""
        if self.load_dir is None:
            return
        restored = ckpt.restore(
            self.load_dir,
            self.recipe,
            chunks=self.model.chunks,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            padded_vocab_size=self.padded_vocab_size,
            log=self.logger.info,
            save=self.save_dir,
            fallback=self.resume_fallback,
            from_scratch=self.from_scratch,
        )
        if restored is None:
            if self.from_scratch:
                self.logger.truncate_after(0)  # the old run's metrics would read as this run's
            return
        if not restored.training_state:  # weights only: the run starts at iteration 0
            return
        s = self.state
        s.iteration, s.consumed_train_samples = restored.iteration, restored.consumed_train_samples
        s.skipped_iterations, s.nan_iterations = restored.skipped_iterations, restored.nan_iterations
        self.logger.truncate_after(restored.iteration)

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Optional[Path]:
        if self.save_dir is None:
            return None
        s = self.state
        bad = self._first_nonfinite_weight()
        if _any_rank(bad is not None):  # every rank refuses together: no rank writes a part of it
            where = f" ({bad})" if bad else " (on another rank)"
            raise NonFiniteTrainingError(
                f"iteration {s.iteration}: the weights hold NaN/inf values{where}; no checkpoint is saved from "
                f"them, {self.save_dir} keeps its last good one: lower training.lr and resume from it"
            )
        args = ckpt.megatron_args(
            self.recipe,
            self.padded_vocab_size,
            iteration=s.iteration,
            consumed_train_samples=s.consumed_train_samples,
            params_dtype=self.params_dtype,
        )
        start = time.time()
        path = ckpt.save_checkpoint(
            self.save_dir,
            s.iteration,
            model_state=[stage.state_dict() for stage in self.model.chunks],
            args=args,
            recipe=self.recipe,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            consumed_train_samples=s.consumed_train_samples,
            extra={"train_counters": {"skipped_iterations": s.skipped_iterations, "nan_iterations": s.nan_iterations}},
            save_optim=self.save_optim,
            tokenizer_files=self.tokenizer_files,
        )
        self.logger.info(f"saved checkpoint at iteration {s.iteration:7d} to {path} ({time.time() - start:.2f} s)")
        return path

    @torch.no_grad()
    def _first_nonfinite_weight(self) -> Optional[str]:
        """The name of this rank's first model weight or fp32 master holding a NaN/inf, else None."""
        named = list(self.model.module.named_parameters())
        masters = [p for g in self.optimizer.param_groups for p in g["params"]]
        tensors = [p for _, p in named] + masters
        if not tensors:
            return None
        # one device sync (the distributed optimizer's placeholder group of a rank that owns nothing is on the CPU)
        finite = torch.stack([t.isfinite().all().to(self.device) for t in tensors]).tolist()
        if all(finite):
            return None
        index = finite.index(False)
        return named[index][0] if index < len(named) else "an fp32 master weight"

    # -- signals -------------------------------------------------------------------------------
    def _install_signal_handlers(self):
        previous = {}

        def handler(signum, frame):  # noqa: ARG001
            self._stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
        return previous

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, dataset, kind: str, consumed: int, iters: int) -> Optional[dict]:
        if dataset is None or iters <= 0:
            return None
        t = self.recipe.training
        iterator = batch_iterator(
            dataset,
            consumed_samples=consumed,
            micro_batch_size=t.micro_batch_size,
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            device=self.device,
            wrap=True,
        )
        self.model.eval()
        total, count = None, 0  # the sum stays on the device: one read for the whole evaluation
        try:
            with torch.no_grad():
                for _ in range(iters):
                    losses = self.forward_backward(
                        gpt_forward_step,
                        iterator,
                        self.model,
                        self.num_micro_batches,
                        seq_length=self.recipe.model.seq_length,
                        micro_batch_size=t.micro_batch_size,
                        forward_only=True,
                    )
                    if losses:
                        part = _loss_sum(losses)
                        total = part if total is None else total + part
                        count += len(losses)
        finally:
            iterator.close()
        self.model.train()
        loss = _average_over_dp(float(total) / count) if count else float("nan")
        return self.logger.evaluation(kind, self.state.iteration, loss) if count else None

    def _valid_consumed(self, iteration: int) -> int:
        """Megatron's consumed validation samples before the evaluation at `iteration`."""
        t = self.recipe.training
        if iteration < t.eval_interval:
            return 0
        return (iteration // t.eval_interval - 1) * t.eval_iters * t.global_batch_size

    # -- one iteration -------------------------------------------------------------------------
    def train_step(self, data_iterator) -> tuple[Optional[torch.Tensor], bool, Optional[float]]:
        """(loss averaged over micro batches and DP, a 0-dim float64 tensor on the device that nothing has
        read yet, None on ranks that hold no loss (not the last pipeline stage); ok; grad norm). ok False:
        the optimizer skipped the update, on every rank alike: grad norm None for an fp16 overflow,
        non-finite for the NaN guard (a non-finite loss on any rank, or a non-finite gradient norm).
        The only host syncs are the optimizer's: the grad norm (and fp16's overflow flag)."""
        t = self.recipe.training
        self.model.zero_grad_buffer()  # gradients accumulate in the wrapper's main_grad buffers
        self.optimizer.zero_grad()
        losses = self.forward_backward(
            gpt_forward_step,
            data_iterator,
            self.model,
            self.num_micro_batches,
            seq_length=self.recipe.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
            loss_scale=self.optimizer.loss_scale,
        )
        loss = _average_tensor_over_dp(_loss_sum(losses) / len(losses)) if losses else None
        # The NaN guard's loss check stays on the device: the optimizer folds it into the norm's reduction.
        ok, grad_norm, _ = self.optimizer.step(nonfinite_loss=False if loss is None else ~torch.isfinite(loss))
        if ok:
            self.scheduler.step_iteration()
        return loss, ok, grad_norm

    def _log_interval(
        self,
        lr: float,
        grad_norm: Optional[float],
        loss: Optional[float],
        skipped_now: int,
        nan_now: int,
        data_wait_s: float = 0.0,
    ) -> None:
        """loss: the mean over the interval's iterations that stepped, None when none did; grad_norm:
        the last iteration's, None when it was skipped (the NaN guard's non-finite norm is not a value)."""
        t, s = self.recipe.training, self.state
        grad_norm = finite_or_none(grad_norm)
        elapsed = time.time() - s.interval_start
        per_iter = elapsed / max(s.interval_iterations, 1)
        tflops = flops_lib.tflops_per_device(
            self.flops_per_iteration, per_iter, max(self.recipe.parallel.world_size, 1)
        )
        tokens_per_s = t.global_batch_size * self.recipe.model.seq_length / per_iter
        mfu = flops_lib.mfu(tflops, self.peak_tflops)
        # The one record of this interval: the log line, metrics.jsonl and TensorBoard are all made from it,
        # so a new metric is one entry here.
        record = {
            "iteration": s.iteration,
            "consumed_samples": s.consumed_train_samples,
            "lm_loss": loss,
            "lr": lr,
            "global_batch_size": t.global_batch_size,
            "grad_norm": grad_norm,
            "loss_scale": self.optimizer.loss_scale,
            "elapsed_ms": per_iter * 1000.0,
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "skipped": skipped_now,
            "nan": nan_now,
            "batch_generator_ms": data_wait_s * 1000.0 / max(s.interval_iterations, 1),
            "batch_generator_share": data_wait_s / elapsed if elapsed > 0 else 0.0,
        }
        if mfu is not None:
            record["mfu"] = mfu
        self.logger.train(record, train_iters=t.train_iters)

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        t, s = self.recipe.training, self.state
        self.maybe_resume()
        data_iterator = None
        if s.iteration < t.train_iters:
            data_iterator = batch_iterator(
                self.train_ds,
                consumed_samples=s.consumed_train_samples,
                micro_batch_size=t.micro_batch_size,
                dp_rank=ps.get_data_parallel_rank(),
                dp_size=ps.get_data_parallel_world_size(),
                device=self.device,
            )
        previous_handlers = self._install_signal_handlers()
        last_valid, stopped_by = None, None
        saved_at = None
        try:
            self.model.train()
            s.interval_start, s.interval_iterations = time.time(), 0
            skipped_since, nan_since, loss_sum, loss_count = 0, 0, None, 0  # loss_sum: on the device
            last_update = s.iteration  # the last iteration that updated the weights
            waited_before = 0.0  # the batch generator's wait at the last log line
            while s.iteration < t.train_iters:
                loss, ok, grad_norm = self.train_step(data_iterator)
                s.iteration += 1
                s.interval_iterations += 1
                s.consumed_train_samples += t.global_batch_size
                # Every rank takes the same branch: ok and grad_norm are the optimizer's reduced verdict.
                if ok:
                    s.consecutive_nan, last_update = 0, s.iteration
                    if loss is not None:
                        loss_sum, loss_count = (loss if loss_sum is None else loss_sum + loss), loss_count + 1
                else:
                    s.skipped_iterations += 1
                    skipped_since += 1
                    if grad_norm is not None:  # the NaN guard (None: an fp16 overflow, the scaler's business)
                        s.nan_iterations += 1
                        nan_since += 1
                        s.consecutive_nan += 1
                diverged = s.consecutive_nan >= t.max_consecutive_nan_steps
                if s.iteration % t.log_interval == 0 or diverged:
                    mean_loss = float(loss_sum) / loss_count if loss_count else None  # the interval's one read
                    self._log_interval(
                        self.optimizer.param_groups[0]["lr"],
                        grad_norm,
                        mean_loss,
                        skipped_since,
                        nan_since,
                        data_iterator.wait_seconds - waited_before,
                    )
                    waited_before = data_iterator.wait_seconds
                    s.interval_start, s.interval_iterations = time.time(), 0
                    skipped_since, nan_since, loss_sum, loss_count = 0, 0, None, 0
                if diverged:
                    self.logger.close()
                    raise NonFiniteTrainingError(
                        f"iteration {s.iteration}: the loss or gradient norm was NaN/inf in {s.consecutive_nan} "
                        f"iterations in a row (training.max_consecutive_nan_steps={t.max_consecutive_nan_steps}); "
                        f"none of them updated the weights, which are those of iteration {last_update}: "
                        "lower training.lr (or check the data and model.init_method_std) and resume from the last "
                        "checkpoint"
                    )
                if s.iteration % t.eval_interval == 0:
                    last_valid = self.evaluate(self.valid_ds, "valid", self._valid_consumed(s.iteration), t.eval_iters)
                if t.save_interval and s.iteration % t.save_interval == 0:
                    self.save()
                    saved_at = s.iteration
                # Every rank stops after the same iteration. Agreeing costs a collective and a host read, so
                # several processes agree every STOP_CHECK_INTERVAL iterations (or at log lines, if more often):
                # a scheduler's grace period after SIGTERM is tens of seconds, whatever log_interval says.
                agree_now = s.iteration % min(t.log_interval, STOP_CHECK_INTERVAL) == 0 or not _distributed()
                if agree_now and _any_rank(self._stop_signal is not None):
                    stopped_by = signal.Signals(self._stop_signal or signal.SIGTERM).name
                    break
            if stopped_by is None and s.iteration % t.eval_interval != 0:
                last_valid = (
                    self.evaluate(
                        self.valid_ds, "valid", self._valid_consumed(s.iteration + t.eval_interval), t.eval_iters
                    )
                    or last_valid
                )
            if saved_at != s.iteration:
                self.save()
            test = None
            if stopped_by is None:
                test = self.evaluate(self.test_ds, "test", 0, t.eval_iters)
        finally:
            if data_iterator is not None:
                data_iterator.close()
            for sig, previous in previous_handlers.items():
                signal.signal(sig, previous)
        if self.logger.writer:
            write_loss_curve(self.run_dir, title=f"{self.recipe.name} [{self.recipe.hash}]")
        self.logger.close()
        summary = {
            "iteration": s.iteration,
            "consumed_train_samples": s.consumed_train_samples,
            "skipped_iterations": s.skipped_iterations,
            "nan_iterations": s.nan_iterations,
            "valid": last_valid,
            "test": test,
            "run_dir": str(self.run_dir),
            "checkpoint": (str(checkpoint_format.iteration_dir(self.save_dir, s.iteration)) if self.save_dir else None),
            "stopped_by": stopped_by,
        }
        if stopped_by is not None:
            self.logger.info(
                f"received {stopped_by}: saved checkpoint at iteration {s.iteration} to "
                f"{summary['checkpoint']}; exiting"
            )
        if self.logger.writer:
            write_summary(self.run_dir, summary)
        self.logger.info("summary: " + strict_json(summary))
        return summary


def _is_log_writer() -> bool:
    """The last pipeline stage's first TP/DP rank holds the losses; it writes the run outputs."""
    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _loss_sum(losses: list[dict]) -> torch.Tensor:
    """The micro batches' "lm loss" summed in float64 on their device, without reading them."""
    return torch.stack([d["lm loss"].detach() for d in losses]).double().sum()


def _any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (a signal may reach the ranks of a job at different
    iterations; all of them must save the same one and leave together)."""
    return not ps.all_ranks_ok(not flag)


def _average_tensor_over_dp(value: torch.Tensor) -> torch.Tensor:
    """The mean of a 0-dim device tensor over DP, left on the device (the all-reduce reads nothing)."""
    group = ps.get_data_parallel_group()
    if group is None or ps.get_data_parallel_world_size() == 1:
        return value
    import torch.distributed as dist

    value = value.to(ps.get_collective_device())
    dist.all_reduce(value, group=group)
    return value / ps.get_data_parallel_world_size()


def _average_over_dp(value: float) -> float:
    group = ps.get_data_parallel_group()
    if group is None or ps.get_data_parallel_world_size() == 1:
        return value
    import torch.distributed as dist

    device = ps.get_collective_device()
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return float(tensor.item()) / ps.get_data_parallel_world_size()
