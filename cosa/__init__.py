"""CoSA: training-free block-sparse attention prefill for Hopper GPUs (proxy-kernel co-design).

``cosa.prefill`` runs KAP (the proxy that emits ordered block lists) then OSK (the ordered-skipping
attention kernel) over a paged KV cache; ``cosa.reference`` is the PyTorch reference of the same
semantics (docs/spec.md) and the CPU implementation of the ops."""

import torch

try:
    from . import _C  # noqa: F401  (registers the schemas and the CUDA kernels of torch.ops.cosa)
except ImportError as error:  # a source checkout that was never built
    _C_AVAILABLE = False
    _C_IMPORT_ERROR = error
else:
    _C_AVAILABLE = True
    _C_IMPORT_ERROR = None

from . import reference, testing  # noqa: E402

if _C_AVAILABLE:
    from . import ops as _ops

    _ops.register()

from .api import device_checks_enabled, kap, osk, prefill, set_device_checks, sparse_attention  # noqa: E402


def cuda_kernels_available() -> bool:
    """True when torch.ops.cosa has CUDA kernels (the extension was built for sm_90a)."""
    return _C_AVAILABLE and torch._C._dispatch_has_kernel_for_dispatch_key("cosa::osk", "CUDA")


__version__ = "0.1.0"
__all__ = ["prefill", "kap", "osk", "sparse_attention", "reference", "testing", "cuda_kernels_available",
           "set_device_checks", "device_checks_enabled"]
