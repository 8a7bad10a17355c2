"""Megatron checkpoint (any TP/PP layout, any version) -> Hugging Face GPT2LMHeadModel directory.

Offline: the tokenizer comes from local vocab.json/merges.txt files, never from the Hub.
The output appears atomically: everything is written into a temporary sibling directory that is
renamed onto the target at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_core.checkpoint_format import RECIPE_FILENAME, tokenizer_copies
from megatron_core.config import ModelSpec
from megatron_core.convert.gpt2_mapping import megatron_to_gpt2_state
from megatron_core.convert.shards import MergedCheckpoint, read_checkpoint
from megatron_core.errors import UserError
from megatron_core.files import publish_directory
from megatron_core.log import get_logger

_LOG = get_logger(__name__, tag="convert")

EOD_TOKEN = "<|endoftext|>"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMATS = ("safetensors", "bin", "both")
PROVENANCE_FILE = "provenance.json"
_MODEL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")


def eod_id_of(tokenizer) -> Optional[int]:
    """The HF tokenizer's id of <|endoftext|>, or None when its vocab has none."""
    return tokenizer.convert_tokens_to_ids(EOD_TOKEN) if EOD_TOKEN in tokenizer.get_vocab() else None


def gpt2_model(state: dict, shape: ModelSpec, eod_id: Optional[int], args=None, attn_implementation: str = "sdpa"):
    """Our merged Megatron state as a transformers GPT2LMHeadModel (fp32, CPU), built in memory with the
    mapping `invoke convert` writes: what evaluation and bench.train's baseline start from."""
    from transformers import GPT2LMHeadModel

    config = gpt2_config(shape, eod_id, torch.float32, args)
    config._attn_implementation = attn_implementation
    model = GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict(megatron_to_gpt2_state(state, shape), strict=False)
    if unexpected or [k for k in missing if not (shape.tied_embeddings and k == "lm_head.weight")]:
        raise UserError(f"the weights do not map onto GPT2 (missing {missing}, unexpected {unexpected})")
    if shape.tied_embeddings:
        model.tie_weights()
    return model


def gpt2_config(shape: ModelSpec, eod_id: Optional[int], dtype: torch.dtype, args=None):
    from transformers import GPT2Config

    dropout = getattr(args, "hidden_dropout", 0.1) if args is not None else 0.1
    attn_dropout = getattr(args, "attention_dropout", 0.1) if args is not None else 0.1
    return GPT2Config(
        vocab_size=shape.padded_vocab_size,
        n_positions=shape.max_position_embeddings,
        n_embd=shape.hidden_size,
        n_layer=shape.num_layers,
        n_head=shape.num_attention_heads,
        n_inner=shape.ffn_hidden_size,
        activation_function="gelu_new" if shape.gelu_approximation == "tanh" else "gelu",
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=attn_dropout,
        layer_norm_epsilon=shape.layernorm_epsilon,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=shape.tied_embeddings,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        architectures=["GPT2LMHeadModel"],
        tokenizer_class="GPT2TokenizerFast",
        dtype=str(dtype).replace("torch.", ""),
    )


def find_tokenizer_files(ckpt: MergedCheckpoint, vocab_file=None, merge_file=None) -> tuple[Path, Path]:
    """Explicit files first, then the copy inside the checkpoint directory (training and import-hf
    write one), then the files the checkpoint's args name (Megatron-LM's way), then its recipe's."""
    candidates = []
    if vocab_file or merge_file:
        if not (vocab_file and merge_file):
            raise UserError("pass both --vocab-file and --merge-file (a GPT2 BPE tokenizer needs both)")
        candidates.append(("--vocab-file/--merge-file", vocab_file, merge_file))
    candidates.append(("the checkpoint directory", *tokenizer_copies(Path(ckpt.source).parent)))
    args = ckpt.args
    if args is not None and getattr(args, "vocab_file", None) and getattr(args, "merge_file", None):
        candidates.append(("checkpoint args", args.vocab_file, args.merge_file))
    tok = (ckpt.recipe or {}).get("tokenizer") or {}
    if tok.get("vocab_file") and tok.get("merge_file"):
        candidates.append(("checkpoint recipe", tok["vocab_file"], tok["merge_file"]))
    for origin, vocab, merges in candidates:
        vocab, merges = Path(vocab), Path(merges)
        if vocab.is_file() and merges.is_file():
            _LOG.info(f"tokenizer from {origin}: {vocab}, {merges}")
            return vocab, merges
        if origin.startswith("--"):
            raise UserError(f"tokenizer files not found: {vocab if not vocab.is_file() else merges}")
    tried = "; ".join(f"{o}: {v}" for o, v, _ in candidates) or "none recorded in the checkpoint"
    raise UserError(f"cannot find the run's vocab.json/merges.txt (tried {tried}); pass --vocab-file and --merge-file")


def save_tokenizer(vocab: Path, merges: Path, out_dir: Path, model_max_length: Optional[int] = None):
    """GPT2TokenizerFast from the files (from_pretrained on a dir: the `vocab_file=` kwargs build an
    empty tokenizer in transformers 5, docs/hf-conversion.md "Tokenizer files") and save it; returns the tokenizer.
    `model_max_length`: the model's positions (else transformers writes 1e30, and text past the positions
    reaches the model and fails there with an IndexError)."""
    from transformers import GPT2TokenizerFast

    with tempfile.TemporaryDirectory() as src:
        shutil.copyfile(vocab, Path(src) / "vocab.json")
        shutil.copyfile(merges, Path(src) / "merges.txt")
        vocab_map = json.loads(Path(vocab).read_text())
        special = {k: EOD_TOKEN for k in ("bos_token", "eos_token", "unk_token")} if EOD_TOKEN in vocab_map else {}
        limit = {"model_max_length": model_max_length} if model_max_length else {}
        tokenizer = GPT2TokenizerFast.from_pretrained(src, **special, **limit)
    if not tokenizer.encode("def f(x):\n    return x"):
        raise UserError(f"tokenizer from {vocab} encodes text to nothing; the vocab/merges files are broken")
    tokenizer.save_pretrained(out_dir)
    # transformers 5 saves only tokenizer.json; keep the BPE files too (4.x and Megatron read them),
    # and name the class so that 4.x loads the fast tokenizer (5.x maps it to the same class).
    shutil.copyfile(vocab, out_dir / "vocab.json")
    shutil.copyfile(merges, out_dir / "merges.txt")
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "GPT2TokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer


def holds_model(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in _MODEL_FILES)


def write_weights(state: dict, out_dir: Path, fmt: str) -> list[str]:
    written = []
    if fmt in ("safetensors", "both"):
        from safetensors.torch import save_file

        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        written.append("model.safetensors")
    if fmt in ("bin", "both"):
        torch.save(state, out_dir / "pytorch_model.bin")
        written.append("pytorch_model.bin")
    return written


def publish_dir(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished temp dir onto the target (replacing an old one only with overwrite)."""
    if target.exists() and holds_model(target) and not overwrite:
        raise UserError(f"{target} already holds a model; pass --overwrite to replace it")
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    publish_directory(tmp, target, set_aside=old)
    shutil.rmtree(old, ignore_errors=True)


def convert_checkpoint(
    load: Union[str, Path],
    save: Union[str, Path],
    iteration=None,
    format: str = "safetensors",
    dtype: Optional[str] = None,
    vocab_file=None,
    merge_file=None,
    overwrite: bool = False,
) -> dict:
    """Convert one iteration of a Megatron checkpoint; returns a summary dict (also the provenance)."""
    if format not in FORMATS:
        raise UserError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    save = Path(save)
    if holds_model(save) and not overwrite:
        raise UserError(f"{save} already holds a model; pass --overwrite to replace it")
    start = time.time()
    ckpt = read_checkpoint(load, iteration)
    vocab, merges = find_tokenizer_files(ckpt, vocab_file, merge_file)
    out_dtype = DTYPES[dtype] if dtype else ckpt.dtype
    _LOG.info(
        f"TP {ckpt.tensor_parallel} x PP {ckpt.pipeline_parallel}, checkpoint_version "
        f"{ckpt.checkpoint_version}, {ckpt.spec.num_layers} layers, {ckpt.dtype} -> {out_dtype}"
    )
    state = {k: v.to(out_dtype) for k, v in megatron_to_gpt2_state(ckpt.state, ckpt.spec).items()}

    save.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{save.name}.tmp-", dir=save.parent))
    try:
        positions = ckpt.spec.max_position_embeddings
        tokenizer = save_tokenizer(vocab, merges, tmp, model_max_length=positions)
        eod_id = eod_id_of(tokenizer)
        if eod_id is None:
            _LOG.warning(f"the vocab has no {EOD_TOKEN}; bos/eos left unset")
        if len(tokenizer) > ckpt.spec.padded_vocab_size:
            raise UserError(
                f"the tokenizer has {len(tokenizer)} tokens but the model only "
                f"{ckpt.spec.padded_vocab_size} embedding rows; wrong --vocab-file?"
            )
        config = gpt2_config(ckpt.spec, eod_id, out_dtype, ckpt.args)
        config.save_pretrained(tmp)
        _generation_config(eod_id, positions).save_pretrained(tmp)
        files = write_weights(state, tmp, format)
        carried_recipe = Path(ckpt.source).parent / RECIPE_FILENAME
        if carried_recipe.is_file():  # the run's recipe travels with the model: evaluate --model reads it
            shutil.copyfile(carried_recipe, tmp / RECIPE_FILENAME)
        recipe = ckpt.recipe or {}
        summary = {
            "recipe_name": recipe.get("name"),
            "recipe_version": recipe.get("version"),
            "recipe_hash": ckpt.recipe_hash,
            "iteration": ckpt.iteration,
            "source": os.path.abspath(ckpt.source),
            "checkpoint_version": ckpt.checkpoint_version,
            "tensor_model_parallel_size": ckpt.tensor_parallel,
            "pipeline_model_parallel_size": ckpt.pipeline_parallel,
            "source_dtype": str(ckpt.dtype).replace("torch.", ""),
            "dtype": str(out_dtype).replace("torch.", ""),
            "weights": files,
            "num_parameters": sum(v.numel() for v in state.values()),
            "save": str(save),
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        _readable_by_all(tmp)
        publish_dir(tmp, save, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _LOG.info(
        f"wrote {save} ({summary['num_parameters']:,} parameters, {', '.join(files)}) in {time.time() - start:.1f}s"
    )
    return summary


def _generation_config(eod_id, max_length: int):
    """max_length: the model's positions, so that a generate() without max_new_tokens stops there."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id, max_length=max_length)


def _readable_by_all(directory: Path) -> None:
    """mkdtemp makes 0700 and safetensors writes 0600: give the model the modes an ordinary directory and files
    get under the umask (0755/0644 by default), so others on a shared disk can read it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)
