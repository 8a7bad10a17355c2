"""Train a recipe: `python -m megatron_core.pretrain_gpt --recipe R [--set k=v ...] [--run-dir D] ...`

Builds what the loop needs (process groups, seeds, model, optimizer, datasets), logs every choice
once at start-up, and runs megatron_core.training.trainer.Trainer. Importable as

    train(recipe, run_dir, data_prefix, tokenizer_files, load=None, save=None, ...) -> summary dict
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_core import parallel_state as ps
from megatron_core import workflow
from megatron_core.config import Recipe, load_recipe, validate
from megatron_core.errors import UserError
from megatron_core.log import configure as configure_logging

DEFAULT_WORKDIR = "work"


class TrainingConfigError(UserError):
    """A recipe value that the training loop cannot run with."""


def check_training_values(recipe: Recipe) -> None:
    """Refuse, before any work, what the recipe's own validation cannot know: whether this host can train it
    (fp16 and Apex's FusedAdam need CUDA). Every rule on the values alone is config.validate's, applied
    here too for a recipe not made by load_recipe."""
    validate(recipe)
    t = recipe.training
    problems = []
    if t.fp16 and trains_on(recipe) == "cpu":
        where = "cpu" if t.device == "cpu" else f"{t.device} (no CUDA GPU visible, so cpu)"
        problems.append(
            f"training.fp16 needs a CUDA GPU but training.device is {where}: fp16 is for GPUs (no "
            "fast fp16 matmuls on a CPU); on a CPU use --set fp16=false --set bf16=true (or fp32), "
            "or train on a GPU with --set device=cuda"
        )
    if t.optimizer == "apex":
        from megatron_core.fusions.apex import fused_adam_problem

        problem = fused_adam_problem(trains_on(recipe))
        problems += [problem] if problem else []
    if problems:
        raise TrainingConfigError("cannot train this recipe: " + "; ".join(problems))


def trains_on(recipe: Recipe) -> str:
    """'cpu' or 'cuda': the device type choose_device gives this recipe on this host (a recipe that
    names its device is a pure function of the recipe; 'auto' asks whether CUDA is visible)."""
    requested = recipe.training.device
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def choose_device(requested: str, local_device: Optional[torch.device] = None) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise TrainingConfigError("training.device is 'cuda' but no CUDA GPU is visible; set --set device=cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return local_device if (local_device is not None and local_device.type == "cuda") else torch.device("cuda")
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def grad_dtype_of(recipe: Recipe) -> torch.dtype:
    """The dtype gradients accumulate and are reduced in (Megatron's accumulate_allreduce_grads_in_fp32,
    forced on for bf16)."""
    _, dtype = precision_of(recipe)
    t = recipe.training
    return torch.float32 if (t.bf16 or t.accumulate_allreduce_grads_in_fp32) else dtype


def precision_regime(recipe: Recipe) -> str:
    """One line for the start-up log: what is stored, stepped, accumulated and scaled in what."""
    precision, dtype = precision_of(recipe)
    master = "the weights themselves (fp32)" if precision == "fp32" else "fp32 copies"
    scaling = "dynamic loss scaling" if precision == "fp16" else "no loss scaling"
    return (
        f"precision: weights {str(dtype).replace('torch.', '')}, master weights {master}, gradients "
        f"accumulated and reduced in {str(grad_dtype_of(recipe)).replace('torch.', '')} main_grad buffers, "
        f"{scaling}"
    )


def precision_of(recipe: Recipe) -> tuple[str, torch.dtype]:
    return recipe.precision, {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[recipe.precision]


def seed_everything(seed: int, device_type: str = "cpu") -> None:
    """Megatron's _set_random_seed: seed + 100 x pipeline rank for python, numpy, torch and the TP tracker.
    `device_type` is the training device's: the tracker forks that device's generator."""
    from megatron_core.tensor_parallel.random import model_parallel_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_manual_seed(seed, device_type)


def _vocab_size(tokenizer_files, vocab_size: Optional[int]) -> int:
    if tokenizer_files:
        from megatron_core.data.tokenizer import GPT2BPETokenizer

        vocab_file, merge_file = tokenizer_files
        return GPT2BPETokenizer(str(vocab_file), str(merge_file)).vocab_size
    if vocab_size is None:
        raise UserError(
            "no tokenizer: give --vocab-file and --merge-file (or --vocab-size for data tokenized elsewhere)"
        )
    return int(vocab_size)


def _data_prefix_arg(data_prefix):
    if isinstance(data_prefix, (list, tuple)):
        items = [str(x) for x in data_prefix]
        return items[0] if len(items) == 1 else items
    return str(data_prefix)


def build_datasets(recipe: Recipe, data_prefix, cache_dir: Path, vocab_size: Optional[int] = None):
    from megatron_core.data.gpt_dataset import build_gpt_datasets, samples_per_split

    t = recipe.training
    counts = samples_per_split(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)
    return build_gpt_datasets(
        _data_prefix_arg(data_prefix),
        split=recipe.data.split,
        seq_length=recipe.model.seq_length,
        num_samples=counts,
        seed=t.seed,
        cache_dir=str(cache_dir),
        vocab_size=vocab_size,
    )


def resolve_run_backends(recipe: Recipe, device: torch.device):
    """The run's kernels, attention and every fusion, from the recipe's keys (fusions/backends.py)."""
    from megatron_core.fusions import resolve_backends

    t = recipe.training
    return resolve_backends(t.fusions, t.fusion_overrides, device, attention=recipe.model.attention_backend)


def build_model(recipe: Recipe, padded_vocab_size: int, device: torch.device, dtype: torch.dtype, fusions):
    from megatron_core.models.gpt import build_gpt_model, compile_layers

    # Weights come from (training.seed, parameter name), not from the per-stage seeded RNG, so every
    # TP x PP layout starts from the single process's weights (Megatron seeds stages apart for dropout).
    # With virtual pipeline stages this is GPTModelChunks, one GPTModel per chunk.
    model = build_gpt_model(
        recipe.model, recipe.parallel, padded_vocab_size, fusions=fusions, init_seed=recipe.training.seed
    )
    model = model.to(device=device, dtype=dtype)
    if recipe.training.compile:
        compile_layers(model)
    return model


def build_model_and_optimizer(recipe: Recipe, padded_vocab_size: int, device: torch.device):
    """(fusion backends, the model to train (DDP-wrapped when DP > 1), the bare GPTModel, optimizer):
    what train() runs and what bench/train.py times, built one way."""
    from megatron_core.distributed import DistributedDataParallel
    from megatron_core.fusions.apex import fused_adam_class, fused_adam_problem
    from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
    from megatron_core.optimizer.optimizer import AdamSettings, MegatronOptimizer

    p, t = recipe.parallel, recipe.training
    precision, dtype = precision_of(recipe)
    fusions = resolve_run_backends(recipe, device)
    model = build_model(recipe, padded_vocab_size, device, dtype, fusions)
    inner_model = model
    fused_adam = None  # training.optimizer adam: torch's AdamW
    if t.optimizer == "apex":  # opt-in; check_training_values refused it already where it cannot run
        problem = fused_adam_problem(device.type)
        if problem:
            raise TrainingConfigError(f"cannot train this recipe: {problem}")
        fused_adam = fused_adam_class()
    scaler = (
        DynamicGradScaler(t.initial_loss_scale, t.min_loss_scale, 2.0, 0.5, t.loss_scale_window, t.hysteresis)
        if precision == "fp16"
        else ConstantGradScaler()
    )
    settings = AdamSettings(t.lr, t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_eps)
    # Wrapped at every DP size, as Megatron does: the wrapper owns the main_grad buffers.
    grad_dtype = grad_dtype_of(recipe)
    if p.use_distributed_optimizer:
        from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer

        model = DistributedDataParallel(model, p, reduce_kind="reduce_scatter", grad_dtype=grad_dtype)
        optimizer = DistributedOptimizer(
            model,
            settings,
            precision=precision,
            clip_grad=t.clip_grad,
            grad_scaler=scaler,
            device=device,
            fused_adam_cls=fused_adam,
        )
    else:
        model = DistributedDataParallel(model, p, grad_dtype=grad_dtype)
        optimizer = MegatronOptimizer(
            inner_model,
            settings,
            precision=precision,
            clip_grad=t.clip_grad,
            grad_scaler=scaler,
            device=device,
            fused_adam_cls=fused_adam,
        )
    return fusions, model, inner_model, optimizer


def _destroys_what_it_started(train_fn):
    """train()'s exit, also on an error: the process group init_distributed made is destroyed (NCCL
    warns at exit without it; some versions hang). A group the caller made is left to the caller."""

    @functools.wraps(train_fn)
    def wrapper(*args, **kwargs):
        from megatron_core.distributed import destroy_distributed

        try:
            return train_fn(*args, **kwargs)
        finally:
            destroy_distributed()

    return wrapper


@_destroys_what_it_started
def train(
    recipe: Recipe,
    run_dir,
    data_prefix,
    tokenizer_files=None,
    load=None,
    save=None,
    *,
    save_optim: bool = True,
    vocab_size: Optional[int] = None,
    datasets=None,
    fallback: bool = True,
    from_scratch: bool = False,
) -> dict:
    """Train `recipe`; outputs under `run_dir` (checkpoints default to run_dir/checkpoints and
    resume from there). `datasets` (train, valid, test) replaces building them from data_prefix."""
    from megatron_core.distributed import init_distributed
    from megatron_core.fusions import apex_status
    from megatron_core.training.checkpointing import check_can_save
    from megatron_core.training import run_lock
    from megatron_core.training.logging import RunLogger
    from megatron_core.training.trainer import Trainer, _is_log_writer

    check_training_values(recipe)
    run_dir = Path(run_dir)
    p, t = recipe.parallel, recipe.training
    # The backend follows where the recipe trains: a CPU recipe talks gloo even on a GPU host
    # (None: NCCL where CUDA is, gloo elsewhere). MEGATRON_DISTRIBUTED_BACKEND=gloo lets several ranks
    # share one GPU (NCCL refuses two ranks on a device): bench/gpu_check.py's 8-rank layout check.
    info = init_distributed(
        backend=os.environ.get("MEGATRON_DISTRIBUTED_BACKEND") or ("gloo" if t.device == "cpu" else None)
    )
    if info.world_size != p.world_size:
        raise TrainingConfigError(
            f"the recipe's parallel.world_size is {p.world_size} but {info.world_size} "
            "processes were started; launch with that many (invoke train) or --set world_size=N"
        )
    if info.world_size > 1:
        ps.initialize_model_parallel(
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size(recipe.model.num_layers),
        )
    device = choose_device(t.device, info.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ps.set_collective_device(device)
    # One job per run directory: local rank 0 of each node takes run.lock (nodes need not share a disk);
    # every rank learns the verdict, so a refusal stops the whole job, not one rank of it.
    job, lock, refusal = run_lock.job_token(), None, None
    if ps.is_local_rank_zero():
        try:
            lock = run_lock.acquire(run_dir, job, log=print)
        except UserError as exc:
            refusal = exc
    if not ps.all_ranks_ok(refusal is None):
        run_lock.release(lock)
        raise refusal or UserError(f"another node could not take the run lock of {run_dir} (its error says why)")
    try:
        precision, dtype = precision_of(recipe)
        seed_everything(t.seed, device.type)

        padded_vocab = recipe.padded_vocab_size(_vocab_size(tokenizer_files, vocab_size))
        fusions, model, inner_model, optimizer = build_model_and_optimizer(recipe, padded_vocab, device)
        try:
            check_can_save(
                run_dir,
                Path(save) if save else run_dir / "checkpoints",
                parameters=sum(x.numel() for x in inner_model.parameters())
                * p.tensor_model_parallel_size
                * p.pipeline_model_parallel_size,
                bytes_per_parameter=dtype.itemsize + (12 if save_optim else 0),
            )  # + fp32 master, exp_avg, exp_avg_sq
            cannot_save = None
        except UserError as exc:
            cannot_save = exc
        if not ps.all_ranks_ok(cannot_save is None):  # each node checks its own disk; all stop together
            raise cannot_save or UserError("another rank cannot save its checkpoints (its error says why)")
        logger = RunLogger(run_dir, writer=_is_log_writer())
        if datasets is None:
            datasets = build_datasets(recipe, data_prefix, run_dir / "index-cache", vocab_size=padded_vocab)
        if datasets[0] is None:
            raise TrainingConfigError(f"data.split {recipe.data.split!r} gives the train split no documents")

        save = Path(save) if save else run_dir / "checkpoints"
        load = Path(load) if load else save
        name = device_name(device)
        n_params = sum(x.numel() for x in inner_model.parameters())
        apex = apex_status()
        logger.info(f"recipe: {recipe.describe()}")
        logger.info(f"recipe source: {recipe.source or '<in memory>'}; overrides: {recipe.overrides or 'none'}")
        vpp = p.virtual_pipeline_model_parallel_size(recipe.model.num_layers)
        schedule = (
            f" (interleaved 1F1B, {vpp} virtual stages of {p.num_layers_per_virtual_pipeline_stage} layers per rank)"
            if vpp is not None
            else ""
        )
        logger.info(
            f"layout: world {p.world_size} = TP {p.tensor_model_parallel_size} x PP "
            f"{p.pipeline_model_parallel_size}{schedule} x DP {p.data_parallel_size}; "
            f"micro batch {t.micro_batch_size}, "
            f"{recipe.num_micro_batches} micro batches per iteration, global batch {t.global_batch_size}"
        )
        logger.info(
            f"device: {name}; precision: {precision}; parameters on this rank: {n_params:,}; "
            f"padded vocab {padded_vocab}"
        )
        logger.info(precision_regime(recipe))
        logger.info(
            f"optimizer: {optimizer.description} (apex FusedAdam importable: "
            f"{bool(apex.get('apex.optimizers.FusedAdam') and apex.get('amp_C'))})"
        )
        logger.info(f"{inner_model.describe_backends()}; compile: {t.compile}")
        logger.info(
            f"lr: {t.lr_decay_style} from {t.lr} to {t.min_lr}, warmup {t.lr_warmup_iters}, "
            f"decay iters {t.decay_iters}; clip_grad {t.clip_grad}; weight decay {t.weight_decay}"
        )
        logger.info(f"run directory: {run_dir}; checkpoints: save {save}, load {load}")
        trainer = Trainer(
            recipe,
            model,
            datasets,
            padded_vocab,
            run_dir,
            optimizer=optimizer,
            device=device,
            save=save,
            load=load,
            save_optim=save_optim,
            params_dtype=str(dtype).replace("torch.", ""),
            logger=logger,
            device_name=name,
            precision=precision,
            tokenizer_files=tokenizer_files,
            resume_fallback=fallback,
            from_scratch=from_scratch,
        )
        return trainer.fit()
    finally:
        run_lock.release(lock)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_core.pretrain_gpt", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe name, family or YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
    parser.add_argument("--run-dir", help="run directory (default: {workdir}/{recipe}/runs/{hash})")
    parser.add_argument(
        "--data-path",
        "--data-prefix",
        dest="data_path",
        nargs="+",
        help="preprocessed prefix, or a blend w1 p1 w2 p2 ...",
    )
    parser.add_argument("--vocab-file")
    parser.add_argument("--merge-file")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size when no tokenizer files are given")
    parser.add_argument("--load", help="checkpoint directory to resume from (default: the --save directory)")
    parser.add_argument("--save", help="checkpoint directory (default: {run-dir}/checkpoints)")
    parser.add_argument("--no-save-optim", action="store_true", help="write model-only checkpoints")
    parser.add_argument(
        "--no-fallback",
        action="store_true",
        help="refuse to resume when the latest checkpoint fails verification (default: fall back "
        "to the newest older one that verifies)",
    )
    parser.add_argument(
        "--from-scratch",
        action="store_true",
        help="start from iteration 0 even where checkpoints exist (their saves replace them)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    configure_logging()
    args = parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if not args.data_path:
            raise UserError("no training data: give --data-path PREFIX (invoke train finds the recipe's own)")
        if (args.vocab_file is None) != (args.merge_file is None):
            raise UserError("--vocab-file and --merge-file go together: give both")
        run_dir = Path(args.run_dir) if args.run_dir else workflow.run_dir(recipe, args.workdir)  # as the tasks name it
        tokenizer_files = (args.vocab_file, args.merge_file) if args.vocab_file else None
        # The writer rank prints `summary: {...}` and writes run_dir/summary.json (Trainer.fit).
        summary = train(
            recipe,
            run_dir,
            args.data_path,
            tokenizer_files,
            load=args.load,
            save=args.save,
            save_optim=not args.no_save_optim,
            vocab_size=args.vocab_size,
            fallback=not args.no_fallback,
            from_scratch=args.from_scratch,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if summary.get("stopped_by"):  # saved, but not finished: a scheduler or a pipeline must not read success
        if ps.is_local_rank_zero():
            print(
                f"stopped by {summary['stopped_by']} at iteration {summary['iteration']} of "
                f"{recipe.training.train_iters} (checkpoint {summary['checkpoint']}); run the same command "
                "again to resume",
                file=sys.stderr,
                flush=True,
            )
        return 128 + signal.Signals[summary["stopped_by"]].value
    return 0


if __name__ == "__main__":
    sys.exit(main())
