#!/usr/bin/env python3
"""Dequantise a GGUF causal LM once into a plain model directory (safetensors, bf16 by default), so
that the model-level benches load it in seconds instead of dequantising it on every run.

    python bench/gguf_to_hf.py FILE.gguf OUT_DIR [--dtype bfloat16|float16]

Needs the ``gguf`` package (transformers reads GGUF through it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import argument_parser, progress  # noqa: E402


def main(argv=None) -> int:
    p = argument_parser(__doc__)
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out_dir", help="the model directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = p.parse_args(argv)
    src = Path(args.gguf)
    if src.suffix != ".gguf" or not src.is_file():
        p.error(f"gguf: {src} is not a .gguf file")

    from models import load_model

    progress(f"dequantising {src}")
    model, tokenizer, _ = load_model(str(src), "cpu", getattr(torch, args.dtype))
    # The weights are plain tensors now; the GGUF marker left on the model only stops them from
    # being saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    progress(f"saved {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
