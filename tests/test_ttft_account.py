"""bench/ttft_account.py on hand-made traces: each GPU activity lands in its part, the attention op's
host range decides what the backend launched, and the parts add up to the request's span."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import ttft_account  # noqa: E402
import vllm_e2e  # noqa: E402

SPAN = "request"


def trace_of(*events):
    return {"traceEvents": [{"ph": "X", **e} for e in events]}


def cpu(name, ts, dur, tid=1, cat="cpu_op"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def launched(name, ts, dur, launch_ts, correlation, tid=1, cat="kernel"):
    """A GPU activity and the host call that launched it."""
    return [{"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "pid": 0, "args": {"correlation": correlation}},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch_ts, "dur": 1, "tid": tid, "pid": 1,
             "args": {"correlation": correlation}}]


def test_parts_add_up_and_each_kernel_lands_in_its_part():
    events = [cpu(SPAN, 0, 1000), cpu("vllm::unified_attention_with_output", 100, 300)]
    events += launched("void kap_score_kernel<128>(KapDeviceArgs)", 120, 50, 110, 1)
    events += launched("void osk_fwd_kernel<Traits>(OskKernelParams)", 170, 100, 115, 2)
    events += launched("void at::native::elementwise_kernel<copy>", 270, 20, 120, 3)   # the backend's copy
    events += launched("void reshape_and_cache_flash_kernel<bf16>", 290, 10, 125, 4)
    events += launched("nvjet_hsh_128x256_gemm", 400, 200, 410, 5)                   # after the attention op
    events += launched("Memcpy HtoD (Pageable -> Device)", 600, 30, 420, 6, cat="gpu_memcpy")
    events += launched("triton_poi_fused_rms_norm_0", 640, 60, 430, 7)
    events += launched("void flash::FlashAttnFwdSm90<...>", 650, 100, 440, 8)          # overlaps the norm by 50
    events += launched("cutlass_gemm_outside_span", 1200, 100, 450, 9)                # after the span: left out
    result = ttft_account.account(trace_of(*events), SPAN, num_layers=2)
    parts = result["parts_ms"]
    expected = {"kap": 0.05, "osk": 0.1, "cosa_backend": 0.02, "kv_cache_write": 0.01, "gemm": 0.2, "copies": 0.03,
                "other_kernels": 0.06, "flash_attn": 0.1, "overlap": -0.05}
    for part, ms in expected.items():
        assert parts[part] == pytest.approx(ms), part
    busy = 0.05 + 0.1 + 0.02 + 0.01 + 0.2 + 0.03 + (0.75 - 0.64)
    assert parts["idle"] == pytest.approx(1.0 - busy)
    assert sum(parts.values()) == pytest.approx(result["window_ms"]) == pytest.approx(1.0)
    assert result["attention_ms"] == pytest.approx(0.05 + 0.1 + 0.02 + 0.1)
    assert result["attention_per_layer_ms"] == pytest.approx(result["attention_ms"] / 2)
    assert result["attention_calls"] == 1 and result["attention_op_found"]
    assert result["gpu_activities"] == 8


def test_the_attention_op_counts_on_its_own_thread_only():
    events = [cpu(SPAN, 0, 100), cpu("vllm::unified_attention_with_output", 10, 50, tid=2)]
    events += launched("void at::native::copy_kernel", 20, 10, 15, 1, tid=1)  # launched by another thread
    events += launched("void at::native::copy_kernel", 40, 10, 30, 2, tid=2)
    parts = ttft_account.account(trace_of(*events), SPAN, 1)["parts_ms"]
    assert parts["copies"] == pytest.approx(0.01) and parts["cosa_backend"] == pytest.approx(0.01)


def test_without_the_attention_op_kernels_are_placed_by_name():
    events = [cpu(SPAN, 0, 100)]
    events += launched("void osk_fwd_kernel<T>", 0, 40, 0, 1)
    events += launched("void at::native::copy_kernel", 50, 10, 1, 2)
    result = ttft_account.account(trace_of(*events), SPAN, 1)
    assert not result["attention_op_found"]
    assert result["parts_ms"]["osk"] == pytest.approx(0.04) and result["parts_ms"]["copies"] == pytest.approx(0.01)
    assert result["parts_ms"]["idle"] == pytest.approx(0.05)


def test_a_trace_without_the_span_or_with_two_is_an_error():
    with pytest.raises(ValueError, match="no span named 'request'"):
        ttft_account.account(trace_of(cpu("other", 0, 10)), SPAN, 1)
    with pytest.raises(ValueError, match="2 spans named 'request', not one"):
        ttft_account.account(trace_of(cpu(SPAN, 0, 10), cpu(SPAN, 20, 30)), SPAN, 1)


def test_the_profiled_request_runs_twice_and_only_the_second_is_recorded():
    """The profiler sets itself up during a first run that it does not record (its start-up would
    otherwise be counted as idle GPU time): the trace holds one span, the second request's."""
    torch = pytest.importorskip("torch")
    durations = iter((0.2, 0.01))  # the first run is far longer: a recorded first span would show it

    def request():
        end = time.perf_counter() + next(durations)
        while time.perf_counter() < end:
            torch.ones(8).sum()

    result = vllm_e2e.profiled_account(request, 1)
    assert next(durations, None) is None, "the request must run twice"
    assert result["window_ms"] < 100, f"the recorded span is the first run's ({result['window_ms']:.1f} ms)"


def test_rows_and_table_of_the_vllm_bench():
    result = ttft_account.account(trace_of(cpu(SPAN, 0, 2000), *launched("osk_fwd_kernel", 0, 1000, 0, 1)), SPAN, 4)
    engines = {("cosa", "long"): {"ttft": [{"n": 130000, "ttft_ms": 2.1, "account": result}, {"n": 8, "ttft_ms": 1}]},
               ("flash_attn", "long"): "exit status 1: failed"}
    rows = vllm_e2e.account_rows(engines)
    assert len(rows) == 1
    row = rows[0]
    assert (row["kind"], row["backend"], row["n"], row["phase"]) == ("account", "cosa", 130000, "long")
    assert row["profiled_ms"] == pytest.approx(2.0) and row["closure"] == pytest.approx(2.0 / 2.1)
    table = {line["part"]: line["cosa 130000"] for line in ttft_account.account_table(rows)}
    assert table["osk"] == pytest.approx(1.0) and table["idle"] == pytest.approx(1.0)
    assert table["attention_per_layer_ms"] == pytest.approx(0.25) and table["measured_ms"] == 2.1
