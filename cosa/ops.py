"""Python registrations for the ops declared in csrc/torch_binding.cpp (``TORCH_LIBRARY(cosa, m)``):
the CPU kernels, which are the reference (cosa.reference), and the fake (meta) kernels that let
``torch.compile`` trace the ops. Both run the ops' argument contract first: the C++ checks of the
binding, reached through ``torch.ops.cosa.check_args``, so that every path raises the same errors.
The dispatcher leaves out the trailing arguments that equal their schema defaults, so these take
the same defaults (cosa.tuning.Tuning's, and cosa.defaults' softmax scale)."""

from __future__ import annotations

import functools
import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import defaults, reference
from .reference import cdiv
from .tuning import Tuning


def _contract_first(op: str, kernel, *, fake: bool = False):
    """``kernel`` behind the argument contract of ``op``; the kernel's parameters are named as
    check_args names them. A fake kernel skips the checks while torch.compile traces (FakeTensors,
    sizes possibly symbolic): the traced call runs the real kernel, which checks. It keeps them for
    a call with real tensors, one of them on 'meta': the dispatcher ranks Meta above every backend,
    so such a call lands in the fake kernel, which must refuse the mixed devices rather than return
    uninitialised memory."""
    signature = inspect.signature(kernel)

    @functools.wraps(kernel)
    def checked(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if not (fake and isinstance(bound.arguments["q"], FakeTensor)):
            torch.ops.cosa.check_args(op, **bound.arguments)
        return kernel(*args, **kwargs)

    return checked


def _sym_num_q_blocks(total_q, batch, max_seqlen_q):
    # Same bound as reference.num_q_blocks_bound, written so that symbolic sizes pass through.
    return torch.sym_min(batch * cdiv(max_seqlen_q, reference.BLOCK), (total_q + (reference.BLOCK - 1) * batch) // reference.BLOCK)


def _lists_like(q, seqused_k, max_seqlen_q, max_seqlen_k):
    hq = q.shape[1]
    nqb = _sym_num_q_blocks(q.shape[0], seqused_k.shape[0], max_seqlen_q)
    return (q.new_empty((hq, nqb, cdiv(max_seqlen_k, reference.BLOCK)), dtype=torch.int32),
            q.new_empty((hq, nqb), dtype=torch.int32))


def _kap_fake(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, stride=Tuning.stride,
              top_p=Tuning.top_p, softmax_scale=defaults.SOFTMAX_SCALE,
              proxy_precision=Tuning.proxy_precision):
    return _lists_like(q, seqused_k, max_seqlen_q, max_seqlen_k)


# The outputs are contiguous whatever the inputs' strides, as the kernels' (and the reference's) are:
# new_empty, not empty_like, which would copy q's strides.
def _osk_fake(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
              softmax_scale=defaults.SOFTMAX_SCALE, delta=Tuning.delta, vote=Tuning.vote):
    return (q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            counts.new_empty(counts.shape))


def _prefill_fake(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  stride=Tuning.stride, top_p=Tuning.top_p, softmax_scale=defaults.SOFTMAX_SCALE,
                  delta=Tuning.delta, vote=Tuning.vote, proxy_precision=Tuning.proxy_precision):
    order, counts = _lists_like(q, seqused_k, max_seqlen_q, max_seqlen_k)
    return (q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32), order, counts,
            counts.new_empty(counts.shape))


def _osk_cpu(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
             softmax_scale=defaults.SOFTMAX_SCALE, delta=Tuning.delta, vote=Tuning.vote):
    # The op's arguments only: reference.osk's own return_skip_trace is no argument of the contract.
    return reference.osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q,
                         softmax_scale, delta, vote)


def _prefill_cpu(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                 stride=Tuning.stride, top_p=Tuning.top_p, softmax_scale=defaults.SOFTMAX_SCALE,
                 delta=Tuning.delta, vote=Tuning.vote, proxy_precision=Tuning.proxy_precision):
    order, counts = reference.kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                  stride, top_p, softmax_scale, proxy_precision)
    out, lse, skipped = reference.osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts,
                                      max_seqlen_q, softmax_scale, delta, vote)
    return out, lse, order, counts, skipped


_KERNELS = (("kap", _kap_fake, reference.kap), ("osk", _osk_fake, _osk_cpu), ("prefill", _prefill_fake, _prefill_cpu))


def schema_mismatch() -> str | None:
    """Why the loaded cosa._C cannot serve these sources (its op schemas name other arguments than
    this file's kernels take: an extension built from older or newer sources), or None."""
    for name, fake, _ in _KERNELS:
        built = [argument.name for argument in getattr(torch.ops.cosa, name).default._schema.arguments]
        expected = list(inspect.signature(fake).parameters)
        if built != expected:
            return (f"its cosa::{name} takes ({', '.join(built)}), these sources call it with "
                    f"({', '.join(expected)})")
    return None


def _no_backward(name: str):
    """The ops' autograd formula: a clear error. Without one, PyTorch's fallback lets a backward through
    them run and fail somewhere else, or give wrong gradients."""

    def backward(ctx, *grads):
        raise NotImplementedError(f"cosa.{name} has no backward: CoSA is an inference (prefill) method; compute "
                                  "gradients through dense attention")

    return backward


def register():
    """Attach the fake and CPU kernels and the autograd formula to the schemas that cosa._C declared."""
    for name, fake, cpu in _KERNELS:
        torch.library.register_fake(f"cosa::{name}")(_contract_first(name, fake, fake=True))
        torch.library.register_kernel(f"cosa::{name}", "cpu")(_contract_first(name, cpu))
        torch.library.register_autograd(f"cosa::{name}", _no_backward(name))


__all__ = ["register", "schema_mismatch"]
