"""CoSA: training-free block-sparse attention prefill for Hopper GPUs (proxy-kernel co-design).

``cosa.prefill`` runs KAP (the proxy that emits ordered block lists) then OSK (the ordered-skipping
attention kernel) over a paged KV cache; ``cosa.reference`` is the PyTorch reference of the same
semantics (docs/spec.md) and the CPU implementation of the ops."""

import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import torch

_EXTENSION_NAMES = {"_C" + suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES}


def _installed_extension() -> Path | None:
    """The compiled extension of an installed cosa distribution other than this tree, if any."""
    for dist in importlib.metadata.distributions(name="cosa"):
        for file in dist.files or ():
            if file.parent.name == "cosa" and file.name in _EXTENSION_NAMES:
                path = Path(dist.locate_file(file))
                if path.is_file() and path.parent.resolve() != Path(__file__).parent.resolve():
                    return path
    return None


def _load_extension(path: Path):
    spec = importlib.util.spec_from_file_location(f"{__name__}._C", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


# Importing the extension registers the schemas and the CUDA kernels of torch.ops.cosa.
_C_AVAILABLE, _C_IMPORT_ERROR = True, None
try:
    from . import _C  # noqa: F401
except ImportError as error:
    _C_AVAILABLE, _C_IMPORT_ERROR = False, error
    if importlib.util.find_spec(f"{__name__}._C") is None:
        # A source tree holding no build. After `pip install .`, Python run from the repository root
        # imports this tree (the current directory leads sys.path): the installed extension serves it.
        _installed = _installed_extension()
        if _installed is None:
            _C_IMPORT_ERROR = ImportError(
                f"{Path(__file__).parent} holds the sources of cosa without its compiled extension cosa._C, "
                "and no installed cosa has one: run `bash scripts/setup.sh` in the repository (it builds "
                "cosa._C in place) or install the package (README, Install)")
        else:
            try:
                _C = _load_extension(_installed)
            except (ImportError, OSError) as load_error:
                _C_IMPORT_ERROR = load_error
            else:
                _C_AVAILABLE, _C_IMPORT_ERROR = True, None

from . import reference, testing  # noqa: E402

if _C_AVAILABLE:
    from . import ops as _ops

    # An extension built from other sources (an older install serving a newer tree, say) would fail
    # at the first call with the dispatcher's words: refuse it here, saying which one and why.
    _mismatch = _ops.schema_mismatch()
    if _mismatch is None:
        _ops.register()
    else:
        _C_AVAILABLE = False
        _C_IMPORT_ERROR = ImportError(
            f"the compiled extension {getattr(_C, '__file__', 'cosa._C')} was built from other sources than "
            f"{Path(__file__).parent} ({_mismatch}): rebuild it with `bash scripts/setup.sh` or reinstall "
            "the package (README, Install)")

from .api import device_checks_enabled, kap, osk, prefill, set_device_checks, sparse_attention  # noqa: E402


def cuda_kernels_available() -> bool:
    """True when torch.ops.cosa has CUDA kernels (the extension was built for sm_90a)."""
    return _C_AVAILABLE and torch._C._dispatch_has_kernel_for_dispatch_key("cosa::osk", "CUDA")


__version__ = "0.1.0"
__all__ = ["prefill", "kap", "osk", "sparse_attention", "reference", "testing", "cuda_kernels_available",
           "set_device_checks", "device_checks_enabled"]
