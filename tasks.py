"""invoke tasks: thin wrappers that resolve a recipe and call the core (or torchrun).

Every recipe task takes --recipe (a file, a recipe name or a family name), --set key=value
(repeatable, typed by the schema) and --workdir (default ./work). A task runs the steps it
needs first, like make; see megatron_core/workflow.py.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from invoke import Collection, Exit, task

from megatron_core import config, workflow
from megatron_core.errors import UserError

DEFAULT_RECIPE = "codeparrot-tiny"
DEFAULT_WORKDIR = "./work"
RECIPE_HELP = {
    "recipe": "recipe file, name or family (default: codeparrot-tiny)",
    "set_": "override a recipe value, key=value (repeatable), e.g. --set lr=1e-4",
    "workdir": "where all outputs of a recipe go (default ./work)",
}


def people_errors(fn):
    """A UserError ends the task with its one-line message and exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
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
def recipes(c, show=None):
    """List the recipes: name, version, GPUs, parameters, tokens to train."""
    if show:
        import yaml

        print(yaml.safe_dump(config.load_recipe(show).to_dict(), sort_keys=False))
        return
    rows = [("name", "version", "family", "GPUs", "parameters", "tokens", "hash")]
    for path in config.list_recipe_files():
        r = config.load_recipe(str(path))
        world = r.parallel.world_size
        on_gpu = "gpu" in r.hardware.lower()
        rows.append(
            (
                r.name,
                str(r.version),
                r.family or "-",
                str(world) if on_gpu else ("cpu" if world == 1 else f"cpu x{world}"),
                _human(r.num_parameters()),
                _human(r.tokens_to_train()),
                r.hash,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


@recipe_task(help={"force": "rebuild even if up to date"})
def corpus(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, force=False):
    """Write the recipe's corpus as loose JSON lines."""
    step = workflow.corpus(_load(recipe, set_), workdir, force=force)
    print(step.directory / "corpus.jsonl")


@recipe_task(help={"force": "rebuild even if up to date"})
def tokenizer(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, force=False):
    """Train (or check and take) the recipe's GPT-2 BPE tokenizer: vocab.json + merges.txt."""
    step = workflow.tokenizer(_load(recipe, set_), workdir, force=force)
    m = step.manifest()
    print(f"{step.directory}: vocab size {m['vocab_size']}, vocab.json {m['vocab_sha256']}, merges.txt {m['merges_sha256']}")


@recipe_task(help={"force": "rebuild even if up to date"})
def preprocess(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, force=False):
    """Tokenize the corpus into Megatron .bin/.idx files."""
    r = _load(recipe, set_)
    step = workflow.preprocess(r, workdir, force=force)
    for prefix in step.manifest()["prefixes"]:
        print(step.directory / prefix)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def _train_command(r: config.Recipe, recipe: str, set_, workdir, nproc, nnodes, node_rank, master_addr,
                   master_port, rdzv_endpoint, load, no_save_optim) -> list[str]:
    from megatron_core.launch import torchrun_command

    vocab, merges = workflow.tokenizer_files(r, workdir)
    extra = ["--workdir", str(workdir), "--run-dir", str(workflow.run_dir(r, workdir)),
             "--vocab-file", str(vocab), "--merge-file", str(merges),
             "--data-path", *[str(x) for x in workflow.data_prefixes(r, workdir)]]
    if load:
        extra += ["--load", load]
    if no_save_optim:
        extra.append("--no-save-optim")
    nproc = nproc or max(1, r.parallel.world_size // max(nnodes, 1))
    if nproc * nnodes == 1:
        cmd = [sys.executable, "-m", "megatron_core.train", "--recipe", r.source]
        for item in set_ or []:
            cmd += ["--set", item]
        return cmd + extra
    return torchrun_command(r.source, list(set_ or []), nproc, nnodes=nnodes, node_rank=node_rank,
                            master_addr=master_addr, master_port=master_port,
                            rdzv_endpoint=rdzv_endpoint, extra_args=extra)


TRAIN_HELP = {
    "nproc": "processes per node (default: the recipe's world size / nnodes)",
    "nnodes": "number of nodes (multi-node through torchrun)",
    "node_rank": "this node's rank",
    "master_addr": "address of node 0",
    "master_port": "port on node 0",
    "rdzv_endpoint": "torchrun rendezvous endpoint host:port (instead of master addr/port)",
    "load": "checkpoint directory to resume from (default: the run's own)",
    "no_save_optim": "write model-only checkpoints",
}


@recipe_task(help=TRAIN_HELP)
def train(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, nproc=0, nnodes=1, node_rank=0,
          master_addr="127.0.0.1", master_port=29500, rdzv_endpoint=None, load=None, no_save_optim=False):
    """Train the recipe (running the missing data steps first); prints the run directory."""
    r = _load(recipe, set_)
    cmd = _train_command(r, recipe, set_, workdir, nproc, nnodes, node_rank, master_addr, master_port,
                         rdzv_endpoint, load, no_save_optim)
    print(f"run directory: {workflow.run_dir(r, workdir)}", flush=True)
    print("+ " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise Exit(f"error: training exited with code {rc}", code=rc)
    print(f"run directory: {workflow.run_dir(r, workdir)}")


# ----------------------------------------------------------------------------------------------
# Conversion and evaluation
# ----------------------------------------------------------------------------------------------


@recipe_task(help={
    "load": "checkpoint directory (default: the recipe run's checkpoints)",
    "iteration": "N, latest or release",
    "save": "output Hugging Face directory (default: <run dir>/hf)",
    "format": "safetensors | bin | both",
    "dtype": "fp32 | fp16 | bf16",
    "overwrite": "replace an existing model in --save",
})
def convert(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, load=None, iteration="latest",
            save=None, format="safetensors", dtype="fp32", overwrite=False):
    """Convert a Megatron-layout checkpoint (any TP/PP) into a transformers GPT2 directory."""
    from megatron_core.convert import convert_checkpoint

    r = _load(recipe, set_)
    run = workflow.run_dir(r, workdir)
    vocab, merges = workflow.tokenizer_files(r, workdir) if load is None else (None, None)
    summary = convert_checkpoint(
        load_dir=load or str(run / "checkpoints"),
        save_dir=save or str(run / "hf"),
        iteration=iteration,
        format=format,
        dtype=dtype,
        vocab_file=vocab,
        merge_file=merges,
        overwrite=overwrite,
    )
    print(json.dumps(summary, indent=2, default=str))


@task(name="import-hf", help={"model": "transformers GPT2 directory", "save": "checkpoint directory to write",
                              "tp": "tensor-parallel size", "pp": "pipeline-parallel size"})
@people_errors
def import_hf(c, model, save, tp=1, pp=1):
    """Write a Megatron-layout checkpoint from a transformers GPT2 directory (to continue training)."""
    from megatron_core.convert import import_hf_checkpoint

    print(json.dumps(import_hf_checkpoint(model, save, tp=tp, pp=pp), indent=2, default=str))


@recipe_task(help={
    "model": "HF model directory (default: the recipe run's converted model)",
    "humaneval": "also run HumanEval (default: the recipe's evaluate.humaneval)",
    "allow_code_execution": "REQUIRED to run generated code (sandboxed subprocess per sample)",
})
def evaluate(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, model=None, humaneval=None,
             allow_code_execution=False):
    """Perplexity on the valid/test splits, and HumanEval pass@k when asked."""
    from megatron_core.evaluate import evaluate as run_evaluate

    r = _load(recipe, set_)
    run = workflow.run_dir(r, workdir)
    results = run_evaluate(
        r,
        hf_dir=model or str(run / "hf"),
        data_prefix=workflow.data_prefixes(r, workdir),
        out_dir=str(run / "eval"),
        humaneval=r.evaluate.humaneval if humaneval is None else humaneval,
        allow_code_execution=allow_code_execution,
    )
    print(json.dumps(results, indent=2, default=str))


@recipe_task(help={"humaneval": "include HumanEval", "allow_code_execution": "run generated code (sandboxed)"})
def pipeline(c, recipe=DEFAULT_RECIPE, set_=None, workdir=DEFAULT_WORKDIR, humaneval=False,
             allow_code_execution=False):
    """corpus -> tokenizer -> preprocess -> train -> convert -> evaluate, each step only if needed."""
    train(c, recipe=recipe, set_=set_, workdir=workdir)
    r = config.load_recipe(recipe, list(set_ or []))
    hf = workflow.run_dir(r, workdir) / "hf"
    if not (hf / "config.json").exists():
        convert(c, recipe=recipe, set_=set_, workdir=workdir)
    evaluate(c, recipe=recipe, set_=set_, workdir=workdir, humaneval=humaneval,
             allow_code_execution=allow_code_execution)


ns = Collection(recipes, corpus, tokenizer, preprocess, train, convert, import_hf, evaluate, pipeline)
