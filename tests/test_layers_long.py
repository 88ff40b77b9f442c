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
