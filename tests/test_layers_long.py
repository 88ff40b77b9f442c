"""bench/layers.py past the model's positions: when YaRN is used, how a YaRN configuration is built, and
what the ``cosa`` rows say of their budgets (the ideal time, KAP's share, the time-weighted speed-up)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import models  # noqa: E402
import layers  # noqa: E402


def row(layer, impl, ms, stage1=1.0, realised=1.0):
    return {"kind": "layer", "layer": layer, "n": 131072, "impl": impl, "ms": ms, "stage1_budget": stage1,
            "realised_budget": realised}


def test_yarn_factor_defaults_to_four_past_the_model_positions_only():
    assert layers.resolve_yarn_factor(None, 131072, 32768) == layers.DEFAULT_YARN_FACTOR == 4.0
    assert layers.resolve_yarn_factor(None, 32768, 32768) is None
    assert layers.resolve_yarn_factor(2.0, 8192, 32768) == 2.0
    assert layers.resolve_yarn_factor(0.0, 131072, 32768) is None


def test_yarn_factor_argument_is_checked(tmp_path):
    (tmp_path / "essay.txt").write_text("Some text.")
    with pytest.raises(SystemExit):
        layers.parse_args(["--model", str(tmp_path), "--haystack", str(tmp_path), "--yarn-factor", "0.5"])
    args = layers.parse_args(["--model", str(tmp_path), "--haystack", str(tmp_path), "--yarn-factor", "0"])
    assert args.yarn_factor == 0


def test_yarn_config_keeps_theta_and_the_model_positions():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(rope_theta=1e6, max_position_embeddings=32768)
    config = models.yarn_config(config, 4.0)
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 32768}


def test_ideal_time_share_of_kap_and_time_weighted_speedup():
    rows = [row(2, "fa4", 80.0), row(2, "cosa", 25.0, 0.25, 0.15), row(2, "kap-fp8", 4.0, 0.25, None),
            row(8, "fa4", 40.0), row(8, "cosa", 20.0, 0.5, 0.5), row(8, "kap-fp8", 2.0, 0.5, None),
            row(9, "cudnn", 10.0), row(9, "cosa", 5.0, 0.5, 0.5)]  # no KAP row: no ideal
    layers.add_speedups(rows)
    layers.add_ideal(rows, "kap-fp8")
    cosa = {r["layer"]: r for r in rows if r["impl"] == "cosa"}
    ideal2 = 80.0 * (0.15 + layers.SKIPPED_BLOCK_FLOOR * 0.10) + 4.0
    assert cosa[2]["ideal_ms"] == pytest.approx(ideal2) and cosa[2]["kap_share"] == pytest.approx(0.05)
    assert cosa[2]["x_ideal"] == pytest.approx(80.0 / ideal2) and cosa[2]["of_ideal"] == pytest.approx(ideal2 / 25.0)
    assert cosa[8]["ideal_ms"] == pytest.approx(22.0)
    assert "ideal_ms" not in cosa[9]
    summary = {s["impl"]: s for s in layers.summarise(rows)}
    assert summary["cosa"]["x_fa4_tw"] == pytest.approx(120.0 / 45.0)  # layer 9 has no FA4 row
    assert summary["cosa"]["x_fa4"] == pytest.approx((80 / 25 + 40 / 20) / 2)
    assert summary["cosa"]["x_cudnn_tw"] == pytest.approx(2.0)



def test_why_the_kernels_cannot_run_names_the_cause(monkeypatch):
    import types

    unbuilt = types.SimpleNamespace(cuda_kernels_built=lambda: False, _C_IMPORT_ERROR=None)
    assert "built with its CUDA kernels" in layers.why_no_kernels(unbuilt)
    built = types.SimpleNamespace(cuda_kernels_built=lambda: True, _C_IMPORT_ERROR=None)
    monkeypatch.setattr(layers.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(layers.torch.cuda, "get_device_name", lambda i: "NVIDIA A100-SXM4-80GB")
    message = layers.why_no_kernels(built)
    assert "Hopper" in message and "A100" in message


def test_serving_variants_and_chunk_arithmetic(tmp_path):
    assert layers.serving_variants(None, None) == {}
    assert layers.serving_variants(16, 16384) == {"cosa-page16": (16, None), "cosa-chunk16384": (128, 16384),
                                                  "cosa-page16-chunk16384": (16, 16384)}
    assert layers.chunk_spans(640, 256) == [(0, 256), (256, 512), (512, 640)]
    assert layers.chunk_spans(640, None) == [(0, 640)]
    # blocks 2, 3 of a sequence see 3 and 4 key blocks; the whole prompt of 5 blocks sees 1 + ... + 5
    assert layers.causal_block_count(256, 512) == 7 and layers.causal_block_count(0, 640) == 15
    assert sum(layers.causal_block_count(a, b) for a, b in layers.chunk_spans(640, 256)) == 15
    base = ["--model", str(tmp_path), "--haystack", str(tmp_path)]
    (tmp_path / "essay.txt").write_text("text")
    for bad in (["--serving-chunk", "100"], ["--serving-chunk", "0"], ["--serving-page-size", "128"],
                ["--serving-page-size", "16", "--lists-only"]):
        with pytest.raises(SystemExit):
            layers.parse_args(base + bad)
    args = layers.parse_args(base + ["--serving-page-size", "16", "--serving-chunk", "256"])
    assert (args.serving_page_size, args.serving_chunk) == (16, 256)


def test_serving_run_matches_one_call_on_the_reference():
    """A chunked call on small pages gives the one call's output and budgets (the ops' CPU path, the
    reference, which computes each query block from its own queries and every key before them)."""
    import torch
    import cosa
    from kernel import InputSet, attach_paged

    n, hq, hkv, d = 640, 4, 2, 64
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv))
    s = InputSet(q=q, k=k, v=v, k_rep=k.repeat_interleave(2, dim=1), v_rep=v.repeat_interleave(2, dim=1))
    attach_paged(s, n, 0, cosa)
    run = layers.LayerRun(cosa, None, 0)
    whole, whole_stats = run.serving_run(s, n, 128, None, None)(return_stats=True)
    chunked, chunked_stats = run.serving_run(s, n, 16, 256, None)(return_stats=True)
    assert chunked.shape == whole.shape == q.shape
    assert torch.isfinite(chunked.float()).all()
    assert torch.allclose(chunked.float(), whole.float(), atol=1e-2, rtol=1e-2)
    for key in ("stage1_budget", "realised_budget"):
        assert chunked_stats[key] == pytest.approx(whole_stats[key])
    assert torch.equal(run.serving_run(s, n, 16, 256, None)(), chunked)
