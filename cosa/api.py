"""The Python API: thin wrappers over ``torch.ops.cosa`` with keyword tuning arguments, optional
``max_seqlen_*`` (derived from the lengths when omitted, which reads them on the host), and the
contiguous ``[B, S, H, d]`` convenience entry point.

Each wrapper first checks its scalar arguments in Python: their types (cosa.validation: a TypeError
naming the argument, before the op schema coerces or refuses them) and the tuning arguments' domains
(cosa.tuning, in the words of the ops' C++ contract); then, when it must derive a max length, it runs
the ops' argument contract (``torch.ops.cosa.check_args``) before reading any index tensor; then it
calls the op, which runs the contract itself."""

from __future__ import annotations

import contextlib
import inspect

import torch

from . import _C_AVAILABLE, _C_IMPORT_ERROR, defaults, reference, validation
from .tuning import Tuning, checked
from .reference import BLOCK, cdiv


def _ops():
    if not _C_AVAILABLE:
        raise RuntimeError(
            f"cosa's compiled extension (cosa._C) is not available ({_C_IMPORT_ERROR}); install the package "
            "with `TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation .` (cosa.reference works without it)")
    return torch.ops.cosa


def device_checks_enabled() -> bool:
    """Whether this thread's CUDA op calls check the contents of their index tensors (see
    ``set_device_checks``)."""
    return _ops().device_checks_enabled()


@contextlib.contextmanager
def _restore_device_checks(previous: bool):
    try:
        yield
    finally:
        _ops().set_device_checks(previous)


def set_device_checks(enabled: bool):
    """Turn the CUDA ops' checks of index-tensor contents on or off for the calling thread.

    With them on (the default), every eager CUDA call checks ``cu_seqlens_q``, ``seqused_k``,
    ``page_table`` and (for ``osk``) ``order``/``counts`` against the layout contract with a few small
    kernels and one host synchronisation, so that bad contents raise a clear error instead of
    reading out of bounds (the op's kernels are enqueued behind the checks and do nothing if one
    failed, so the host waits for the checks' report while the GPU goes on). Turn them off where
    those tensors are right by construction and the host's wait matters; contents that break the
    contract are then undefined behaviour. They are always off while a CUDA graph is being captured;
    shape, dtype and device checks always run, and so do the content checks of CPU tensors (they
    cost no synchronisation there).

    The setting belongs to the calling thread, so that library code can turn the checks off around
    its own calls without touching other threads' calls; a new thread starts from the process-wide
    default, on unless ``COSA_DEVICE_CHECKS=0`` was in the environment when cosa was imported.
    The returned context manager restores this thread's previous setting::

        with cosa.set_device_checks(False):
            out, lse, skipped = cosa.prefill(...)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"cosa.set_device_checks: enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
    return _restore_device_checks(_ops().set_device_checks(enabled))


def _tensors(op, **named):
    return {name: validation.tensor(op, name, value) for name, value in named.items()}


def _not_a_tensor(function, **values):
    """Refuses a tensor given for a length argument (the first one after the op's tensors), naming the
    likely slip: one tensor argument too many, such as ``kap(q, k_cache, v_cache, ...)``, moves every
    later tensor one place on."""
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            raise TypeError(f"cosa.{function.__name__}: {name} must be an int or None, got a tensor: one tensor "
                            f"argument too many? The arguments are cosa.{function.__name__}"
                            f"{inspect.signature(function)}")


def _max_lengths(op, tensors, max_seqlen_q, max_seqlen_k, tuning):
    """``(max_seqlen_q, max_seqlen_k)`` as ints, each derived from the lengths when None. Deriving
    reads the index tensors on the host, after the ops' argument contract has checked them (the same
    checks, in the same words, as the op's), so that a malformed ``cu_seqlens_q`` or ``seqused_k``
    is refused as such rather than failing the computation of a maximum."""
    max_seqlen_q = validation.integer(op, "max_seqlen_q", max_seqlen_q, optional=True)
    max_seqlen_k = validation.integer(op, "max_seqlen_k", max_seqlen_k, optional=True)
    if max_seqlen_q is not None and max_seqlen_k is not None:
        return max_seqlen_q, max_seqlen_k
    return _ops().check_args(op, **tensors, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **tuning)


def kap(q, k_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q=None, max_seqlen_k=None, *,
        stride=Tuning.stride, top_p=Tuning.top_p, softmax_scale=defaults.SOFTMAX_SCALE,
        proxy_precision=Tuning.proxy_precision):
    """KAP (spec section 2): ordered block lists ``(order, counts)``. ``proxy_precision="fp8"``
    scores e4m3 copies of q and k (one scale per 128-token block and head); ``"auto"`` (the default)
    does so where the longest key sequence has 8192 tokens or more (``defaults.FP8_PROXY_MIN_KEYS``)."""
    op = "kap"
    _not_a_tensor(kap, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    tensors = _tensors(op, q=q, k_cache=k_cache, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                       seqused_k=seqused_k)
    tuning = checked(op, stride=stride, top_p=top_p, softmax_scale=softmax_scale, proxy_precision=proxy_precision)
    max_seqlen_q, max_seqlen_k = _max_lengths(op, tensors, max_seqlen_q, max_seqlen_k, tuning)
    return _ops().kap(**tensors, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **tuning)


def osk(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, order, counts, max_seqlen_q=None, *,
        softmax_scale=defaults.SOFTMAX_SCALE, delta=Tuning.delta, vote=Tuning.vote):
    """OSK (spec section 3): attention over the listed blocks in list order, with the in-kernel skip
    decided per 64-row half of each tile (``vote="warpgroup"``) or for the whole tile (``"tile"``).
    Returns ``(out, lse, skipped)``; ``skipped`` counts skipped 64-row halves. Each list must hold
    causal blocks of its query block (checked); a block listed twice is computed twice (not checked)."""
    op = "osk"
    _not_a_tensor(osk, max_seqlen_q=max_seqlen_q)
    tensors = _tensors(op, q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                       seqused_k=seqused_k, order=order, counts=counts)
    tuning = checked(op, softmax_scale=softmax_scale, delta=delta, vote=vote)
    max_seqlen_q = validation.integer(op, "max_seqlen_q", max_seqlen_q, optional=True)
    if max_seqlen_q is None:
        max_seqlen_q, _ = _ops().check_args(op, **tensors, **tuning)  # OSK takes no max_seqlen_k
    return _ops().osk(**tensors, max_seqlen_q=max_seqlen_q, **tuning)


def prefill(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, max_seqlen_q=None, max_seqlen_k=None, *,
            stride=Tuning.stride, top_p=Tuning.top_p, softmax_scale=defaults.SOFTMAX_SCALE,
            delta=Tuning.delta, vote=Tuning.vote, proxy_precision=Tuning.proxy_precision,
            return_stats=False):
    """CoSA sparse prefill over a paged KV cache: KAP then OSK, with no host synchronisation between them.

    Returns ``out [total_q, Hq, d]``, or ``(out, stats)`` with ``return_stats=True``: a dict holding
    ``lse``, ``order``, ``counts``, ``skipped`` and the budgets (which read the lengths on the host)."""
    op = "prefill"
    _not_a_tensor(prefill, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    tensors = _tensors(op, q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                       seqused_k=seqused_k)
    tuning = checked(op, stride=stride, top_p=top_p, softmax_scale=softmax_scale, delta=delta, vote=vote,
                     proxy_precision=proxy_precision)
    max_seqlen_q, max_seqlen_k = _max_lengths(op, tensors, max_seqlen_q, max_seqlen_k, tuning)
    out, lse, order, counts, skipped = _ops().prefill(**tensors, max_seqlen_q=max_seqlen_q,
                                                      max_seqlen_k=max_seqlen_k, **tuning)
    if not return_stats:
        return out
    stage1, realised = reference.budgets(counts, skipped, cu_seqlens_q, seqused_k)
    return out, dict(lse=lse, order=order, counts=counts, skipped=skipped,
                     stage1_budget=stage1, realised_budget=realised)


def _as_paged(x, page_size):
    """``[B, S, H, d]`` -> cache ``[B * ceil(S/page), page, H, d]`` (a view when S is a multiple)."""
    batch, seqlen = x.shape[:2]
    padded = cdiv(seqlen, page_size) * page_size
    if padded != seqlen:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - seqlen))
    return x.reshape(batch * (padded // page_size), page_size, *x.shape[2:])


# The one layout slip a shape check can catch only sometimes: SDPA's [B, H, S, d] is the same rank.
_LAYOUT = ("cosa.sparse_attention takes [B, S, H, d] (sequence before heads, as in FlashAttention); from SDPA's "
           "[B, H, S, d] pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)")


def sparse_attention(q, k, v, *, stride=Tuning.stride, top_p=Tuning.top_p, softmax_scale=defaults.SOFTMAX_SCALE,
                     delta=Tuning.delta, vote=Tuning.vote, proxy_precision=Tuning.proxy_precision,
                     return_stats=False):
    """CoSA causal attention on contiguous tensors in the layout **[batch, sequence, heads, head dim]**:
    ``q [B, Sq, Hq, d]``, ``k, v [B, Sk, Hkv, d]``. This is FlashAttention's layout, not SDPA's
    ``[B, H, S, d]``: from SDPA's, pass ``q.transpose(1, 2)`` (and likewise k, v) and transpose the
    output back. A tensor in SDPA's layout with as many query as KV heads is not refused (its shape is
    valid) and gives attention over the wrong axis.

    ``Sk >= Sq`` (the queries are the last ``Sq`` positions, after a prefix of ``Sk - Sq`` keys of any
    length); ``Hq`` a multiple of ``Hkv``. A thin wrapper that views the inputs as one page per 128
    tokens and calls :func:`prefill` with the device checks off for this call (the index tensors it
    builds are right by construction from the shapes checked here). Returns ``[B, Sq, Hq, d]``, or ``(out, stats)`` with ``return_stats=True``."""
    op = "sparse_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        validation.tensor(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"cosa.sparse_attention: {name} must be a 4-D tensor [B, S, H, d], got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"cosa.sparse_attention: {name} must be on {q.device} like q, got {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"cosa.sparse_attention: k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    batch, seqlen_q, heads_q = q.shape[:3]
    seqlen_k, heads_kv = k.shape[1:3]
    if k.shape[0] != batch:
        raise ValueError(f"cosa.sparse_attention: k has batch {k.shape[0]}, q has {batch}")
    if seqlen_q < 1 or seqlen_k < seqlen_q:
        raise ValueError(f"cosa.sparse_attention: need 1 <= Sq <= Sk, got Sq={seqlen_q} (q.shape[1]), "
                         f"Sk={seqlen_k} (k.shape[1]); {_LAYOUT}")
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"cosa.sparse_attention: the query heads Hq={heads_q} (q.shape[2]) must be a multiple of "
                         f"the KV heads Hkv={heads_kv} (k.shape[2]); {_LAYOUT}")
    pages = cdiv(seqlen_k, BLOCK)
    device = q.device
    page_table = torch.arange(batch * pages, dtype=torch.int32, device=device).reshape(batch, pages)
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device)
    seqused_k = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    with set_device_checks(False):
        result = prefill(q.reshape(batch * seqlen_q, *q.shape[2:]), _as_paged(k, BLOCK), _as_paged(v, BLOCK),
                         page_table, cu_seqlens_q, seqused_k, seqlen_q, seqlen_k, stride=stride, top_p=top_p,
                         softmax_scale=softmax_scale, delta=delta, vote=vote, proxy_precision=proxy_precision,
                         return_stats=return_stats)
    if return_stats:
        out, stats = result
        return out.reshape(q.shape), stats
    return result.reshape(q.shape)
