"""Python registrations for the ops declared in csrc/torch_binding.cpp (``TORCH_LIBRARY(cosa, m)``):
the fake (meta) kernels that let ``torch.compile`` trace them, and the CPU kernels, which are the
reference (cosa.reference) behind the same argument checks as the CUDA path."""

from __future__ import annotations

import torch

from . import reference, validation
from .reference import cdiv


def _sym_num_q_blocks(total_q, batch, max_seqlen_q):
    # Same bound as reference.num_q_blocks_bound, written so that symbolic sizes pass through.
    return torch.sym_min(batch * cdiv(max_seqlen_q, reference.BLOCK), (total_q + (reference.BLOCK - 1) * batch) // reference.BLOCK)


def _list_shapes(q, seqused_k, max_seqlen_q, max_seqlen_k):
    hq = q.shape[1]
    nqb = _sym_num_q_blocks(q.shape[0], seqused_k.shape[0], max_seqlen_q)
    return (hq, nqb, cdiv(max_seqlen_k, reference.BLOCK)), (hq, nqb)


def _kap_fake(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
              stride=8, top_p=0.95, softmax_scale=None):
    order_shape, counts_shape = _list_shapes(q, seqused_k, max_seqlen_q, max_seqlen_k)
    return q.new_empty(order_shape, dtype=torch.int32), q.new_empty(counts_shape, dtype=torch.int32)


def _osk_fake(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
              softmax_scale=None, delta=2000.0):
    return (torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            torch.empty_like(counts))


def _prefill_fake(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  stride=8, top_p=0.95, softmax_scale=None, delta=2000.0):
    order, counts = _kap_fake(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return (torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32), order, counts,
            torch.empty_like(counts))


def _check_kap(op, q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
               stride, top_p, softmax_scale, v_cache=None):
    validation.check_layout(op, q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k)
    validation.check_kap_args(op, stride, top_p, softmax_scale)
    validation.check_lengths(op, q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k)


def _kap_cpu(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
             stride=8, top_p=0.95, softmax_scale=None):
    _check_kap("kap", q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
               stride, top_p, softmax_scale)
    return reference.kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                         stride, top_p, softmax_scale)


def _osk_cpu(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
             softmax_scale=None, delta=2000.0):
    op = "osk"
    validation.check_layout(op, q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, None)
    validation.check_scale(op, softmax_scale)
    validation.check_delta(op, delta)
    validation.check_lengths(op, q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, None)
    validation.check_order(op, q, order, counts, cu_seqlens_q, seqused_k, max_seqlen_q)
    return reference.osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
                         softmax_scale, delta)


def _prefill_cpu(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                 stride=8, top_p=0.95, softmax_scale=None, delta=2000.0):
    _check_kap("prefill", q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
               stride, top_p, softmax_scale, v_cache=v_cache)
    validation.check_delta("prefill", delta)
    order, counts = reference.kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                  stride, top_p, softmax_scale)
    out, lse, skipped = reference.osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts,
                                      max_seqlen_q, softmax_scale, delta)
    return out, lse, order, counts, skipped


def register():
    """Attach the fake and CPU kernels to the schemas that cosa._C declared."""
    for name, fake, cpu in (("kap", _kap_fake, _kap_cpu), ("osk", _osk_fake, _osk_cpu),
                            ("prefill", _prefill_fake, _prefill_cpu)):
        torch.library.register_fake(f"cosa::{name}")(fake)
        torch.library.register_kernel(f"cosa::{name}", "cpu")(cpu)


__all__ = ["register"]
