"""Hugging Face GPT2 directory -> Megatron-layout checkpoint (any TP x PP), so training can go on.

    python -m megatron_core.convert.hf_to_megatron --model HF_DIR --save CKPT_DIR [--tp N] [--pp M]
        [--num-layers-per-virtual-pipeline-stage K]   (the interleaved schedule's layout: model0, model1, ...)

The checkpoint holds the model (checkpoint_version 3.0), args and iteration; no optimizer state.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_core.checkpoint_format import (
    TOKENIZER_FILES,
    TRACKER_FILENAME,
    tokenizer_copies,
    write_checkpoint,
    write_tokenizer_files,
)
from megatron_core.convert.gpt2_mapping import gpt2_to_megatron_state
from megatron_core.convert.megatron_to_hf import PROVENANCE_FILE, publish_dir
from megatron_core.config import ModelSpec
from megatron_core.convert.shards import split_state
from megatron_core.errors import UserError
from megatron_core.log import get_logger

_LOG = get_logger(__name__, tag="convert")


def read_hf_state(model_dir: Path) -> dict:
    st, bin_ = model_dir / "model.safetensors", model_dir / "pytorch_model.bin"
    if st.exists():
        from safetensors.torch import load_file

        return load_file(str(st))
    if bin_.exists():
        return torch.load(bin_, map_location="cpu", weights_only=True)
    raise UserError(
        f"{model_dir} has neither model.safetensors nor pytorch_model.bin (sharded HF weights are not "
        "supported); save the model with save_pretrained(max_shard_size='100GB')"
    )


def import_hf_model(
    model: Union[str, Path],
    save: Union[str, Path],
    tp: int = 1,
    pp: int = 1,
    iteration: Union[int, str] = "release",
    overwrite: bool = False,
    num_layers_per_virtual_pipeline_stage: Optional[int] = None,
) -> dict:
    model, save = Path(model), Path(save)
    config_file = model / "config.json"
    if not config_file.exists():
        raise UserError(f"{model} has no config.json; pass a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    spec = ModelSpec.from_hf_config(config, tp, pp, num_layers_per_virtual_pipeline_stage)
    spec.check("choose a --tp/--pp that divides the model")  # before reading any weights
    if (save / TRACKER_FILENAME).exists() and not overwrite:
        raise UserError(f"{save} already holds a checkpoint; pass --overwrite to replace it")
    hf_state = {k.removeprefix("model."): v for k, v in read_hf_state(model).items()}
    if not spec.tied_embeddings and "lm_head.weight" not in hf_state:
        raise UserError(f"{model}: untied embeddings but no lm_head.weight in the weights")
    state = gpt2_to_megatron_state(hf_state, spec)
    models = split_state(state, spec)
    provenance = {}
    if (model / PROVENANCE_FILE).exists():
        provenance = json.loads((model / PROVENANCE_FILE).read_text())
    extra_args = {}
    tokenizer = [model / name for name in TOKENIZER_FILES]
    if all(p.exists() for p in tokenizer):
        # the tokenizer is copied into the checkpoint directory; the args name it at its final place
        extra_args = dict(zip(("vocab_file", "merge_file"), map(str, tokenizer_copies(save.resolve()))))
    else:
        tokenizer = None
    args = spec.to_args(**extra_args)
    extra = {"recipe_hash": provenance.get("recipe_hash"), "hf_source": str(model.resolve())}
    save.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{save.name}.tmp-", dir=save.parent))
    try:
        write_checkpoint(tmp, models, args, iteration, extra)
        if tokenizer:
            write_tokenizer_files(tmp, *tokenizer)
        if save.exists() and not overwrite and any(save.iterdir()):
            raise UserError(f"{save} is not empty; pass --overwrite to replace it")
        publish_dir(tmp, save, overwrite=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _LOG.info(f"wrote {save} (TP {tp} x PP {pp}, iteration {iteration}) from {model}")
    return {"save": str(save), "tp": tp, "pp": pp, "iteration": iteration, "shape": dataclasses.asdict(spec)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_core.convert.hf_to_megatron", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", required=True, help="Hugging Face GPT2 directory")
    parser.add_argument("--save", required=True, help="output Megatron checkpoint directory")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="write the interleaved schedule's chunked layout (model0, model1, ... per rank)",
    )
    parser.add_argument("--iteration", default="release", help="iteration number to record, or 'release'")
    parser.add_argument("--overwrite", action="store_true")
    ns = parser.parse_args(argv)
    try:
        iteration = ns.iteration if ns.iteration == "release" else int(ns.iteration)
        import_hf_model(
            ns.model, ns.save, ns.tp, ns.pp, iteration, ns.overwrite, ns.num_layers_per_virtual_pipeline_stage
        )
    except (UserError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
