"""python -m megatron_core.convert --load CKPT_DIR --save HF_DIR [...]: Megatron -> Hugging Face GPT2."""

from __future__ import annotations

import argparse
import sys

from megatron_core.convert.megatron_to_hf import DTYPES, FORMATS, convert_checkpoint
from megatron_core.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_core.convert", description=__doc__.split(":")[1].strip())
    parser.add_argument("--load", required=True, help="Megatron checkpoint directory (the training --save)")
    parser.add_argument("--iteration", default=None, help="N, 'latest' (default: the tracker file) or 'release'")
    parser.add_argument("--save", required=True, help="output Hugging Face model directory")
    parser.add_argument("--format", default="safetensors", choices=FORMATS)
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: the checkpoint's dtype")
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in --save")
    ns = parser.parse_args(argv)
    try:
        convert_checkpoint(
            ns.load,
            ns.save,
            iteration=ns.iteration,
            format=ns.format,
            dtype=ns.dtype,
            vocab_file=ns.vocab_file,
            merge_file=ns.merge_file,
            overwrite=ns.overwrite,
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
