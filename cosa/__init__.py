"""CoSA: training-free block-sparse attention prefill for Hopper GPUs (proxy-kernel co-design).

``cosa.prefill`` runs KAP (the proxy that emits ordered block lists) then OSK (the ordered-skipping
attention kernel) over a paged KV cache; ``cosa.reference`` is the PyTorch reference of the same
semantics (docs/spec.md) and the CPU implementation of the ops."""

import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import warnings
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


def torch_mismatch(extension: Path, torch_version: str = torch.__version__) -> str | None:
    """Why the compiled extension at `extension` must not be loaded by this torch, or None. setup.py
    writes the torch it compiled against beside the extension (_C.torch-version); an extension is
    bound to that torch's C++ ABI, and under another one it fails to load or loads without its ops."""
    record = extension.with_name("_C.torch-version")
    if not record.is_file():
        return None
    built_for = record.read_text().strip()
    if built_for == torch_version:
        return None
    return (f"the compiled extension {extension} was built for torch {built_for}, and this Python has torch "
            f"{torch_version}: rebuild it against this torch (`bash scripts/setup.sh` in the repository, or "
            f"`pip install --no-build-isolation .`), or install torch {built_for}")


def _import_extension(path: Path):
    mismatch = torch_mismatch(path)
    if mismatch is not None:
        raise ImportError(mismatch)
    return _load_extension(path)


# Importing the extension registers the schemas and the CUDA kernels of torch.ops.cosa.
_C_AVAILABLE, _C_IMPORT_ERROR = False, None
_in_tree = importlib.util.find_spec(f"{__name__}._C")
# A source tree holding no build: after `pip install .`, Python run from the repository root imports
# this tree (the current directory leads sys.path), and the installed extension serves it.
_extension_path = Path(_in_tree.origin) if _in_tree is not None else _installed_extension()
if _extension_path is None:
    _C_IMPORT_ERROR = ImportError(
        f"{Path(__file__).parent} holds the sources of cosa without its compiled extension cosa._C, and no "
        "installed cosa has one: run `bash scripts/setup.sh` in the repository (it builds cosa._C in place) "
        "or install the package (README, Install)")
else:
    try:
        _C = _import_extension(_extension_path)
    except (ImportError, OSError) as load_error:
        _C_IMPORT_ERROR = load_error
        # Calls through cosa's API raise this error; a caller of torch.ops.cosa would only see that the
        # ops do not exist, so say why at import.
        warnings.warn(f"cosa: torch.ops.cosa is not available: {load_error}", RuntimeWarning, stacklevel=2)
    else:
        _C_AVAILABLE = True

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


def cuda_kernels_built() -> bool:
    """True when torch.ops.cosa has CUDA kernels: the extension was compiled for sm_90a (which needs
    no GPU). Whether they can run here is :func:`cuda_kernels_available`."""
    return _C_AVAILABLE and torch._C._dispatch_has_kernel_for_dispatch_key("cosa::osk", "CUDA")


def cuda_kernels_available() -> bool:
    """True when the CUDA kernels can run here: they are built, and torch sees a Hopper GPU (compute
    capability 9.0). Elsewhere the ops run the PyTorch reference on CPU tensors."""
    return cuda_kernels_built() and torch.cuda.is_available() and any(
        torch.cuda.get_device_capability(i) == (9, 0) for i in range(torch.cuda.device_count()))


__version__ = "0.1.0"
__all__ = ["prefill", "kap", "osk", "sparse_attention", "reference", "testing", "cuda_kernels_available",
           "cuda_kernels_built", "set_device_checks", "device_checks_enabled"]
