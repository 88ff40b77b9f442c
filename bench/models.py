"""Loading a causal LM for the benches (accuracy, RULER, end-to-end, layers): a model directory or a
GGUF file through transformers, with YaRN rope scaling past the model's own positions where asked."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_model(path: str, device: str, dtype: torch.dtype, yarn_factor: float | None = None):
    """``(model, tokenizer, name)`` from a model directory or a ``.gguf`` file (dequantised by
    transformers; needs the ``gguf`` package). SDPA attention, eval mode, on ``device``. With
    ``yarn_factor`` the rotary embedding is YaRN's over the model's own positions, as Qwen2.5 documents
    it for prompts past them and as vLLM runs it (``rope_type`` yarn, ``factor``,
    ``original_max_position_embeddings`` the model's)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    extra = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    where = str(p.parent if extra else p)
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    if yarn_factor is not None:
        extra["config"] = yarn_config(AutoConfig.from_pretrained(where, **extra), yarn_factor)
    model = AutoModelForCausalLM.from_pretrained(where, attn_implementation="sdpa", **{dtype_key: dtype}, **extra)
    model = model.to(device).eval()
    return model, tokenizer, p.stem if extra else p.name


def yarn_rope_parameters(config: dict, factor: float) -> dict:
    """YaRN's rope parameters by ``factor`` over the positions and rope theta of a model configuration
    (``config.json`` as a dict), as Qwen2.5 documents them: what vLLM takes as ``hf_overrides``'
    ``rope_parameters`` and transformers as the configuration's."""
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {"rope_type": "yarn", "factor": float(factor), "rope_theta": theta,
            "original_max_position_embeddings": config.get("max_position_embeddings", 32768)}


def yarn_engine_arguments(model_dir: str, factor: float) -> dict:
    """The vLLM engine arguments that run the model directory ``model_dir`` with YaRN rope scaling by
    ``factor`` over its own positions: ``max_model_len``, the positions it then has, and
    ``hf_overrides``' ``rope_parameters`` (yarn_rope_parameters)."""
    rope = yarn_rope_parameters(json.loads((Path(model_dir) / "config.json").read_text()), factor)
    return {"max_model_len": int(rope["original_max_position_embeddings"] * factor),
            "hf_overrides": {"rope_parameters": rope}}


def yarn_config(config, factor: float):
    """A transformers configuration with YaRN rope scaling by ``factor`` over its own positions
    (transformers 5 keeps the rotary settings in ``rope_parameters``, 4.x in ``rope_scaling``)."""
    yarn = yarn_rope_parameters(config.to_dict(), factor)
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = yarn
    else:
        config.rope_scaling = yarn
    return config
