"""Builds the torch extension cosa._C from the sources and flags of csrc/build_manifest.json.

A CUDA build (the sm_90a kernels plus the CUDA implementations of the ops) is made when torch is
a CUDA build, nvcc is found and TORCH_CUDA_ARCH_LIST names 9.0 / 9.0a (or, when that variable is
unset, a visible GPU is a Hopper). Otherwise the extension declares the op schemas and the
argument checks, and the package's Python reference serves the ops on the CPU. COSA_FORCE_CPU=1
forces the CPU-only build.
Build with: TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation .
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path


def build_environment_error() -> str | None:
    """Why this build cannot make a working extension, or None. The extension must be compiled against
    the torch that will import it, so the build must see the environment's own packages: under pip's
    default build isolation it sees a throwaway environment (without the environment's torch and
    CUTLASS headers), and checking that here stops the build in seconds instead of after a torch
    download and a compile against a torch that will not import the result."""
    how = ("build with `pip install --no-build-isolation .` (after `pip install torch ninja nvidia-cutlass "
           "numpy setuptools wheel`), or run `bash scripts/setup.sh`, which does both")
    site_packages = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    if not site_packages.intersection(os.path.realpath(entry) for entry in sys.path):
        return f"this build runs isolated from the Python environment it installs into (pip's build isolation): {how}"
    try:
        import torch  # noqa: F401
    except ImportError:
        return f"torch is not installed in this Python environment: {how}"
    return None


if (_build_error := build_environment_error()) is not None:
    sys.exit(f"cosa setup: error: {_build_error}")

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "third_party"))
import cutlass_headers  # noqa: E402


def locate_cuda_home() -> None:
    """torch takes the folder above the `nvcc` found on PATH as CUDA_HOME; when that nvcc is a
    symlink or a wrapper script (as /usr/local/bin/nvcc is on some machines), that folder holds no
    CUDA headers. Point CUDA_HOME, before torch reads it, at the toolkit the symlink leads to, or
    else at the standard toolkit folder."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc:
        if (Path(nvcc).parent.parent / "include" / "cuda_runtime.h").exists():  # torch's choice
            return
        toolkit = Path(nvcc).resolve().parent.parent  # where a symlinked nvcc lives
        if (toolkit / "include" / "cuda_runtime.h").exists():
            os.environ["CUDA_HOME"] = str(toolkit)
            return
    if Path("/usr/local/cuda/include/cuda_runtime.h").exists():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


locate_cuda_home()
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = Path(__file__).parent.resolve()
# COSA_BUILD_MANIFEST points the build at another manifest (a build-system check against stub
# kernels, say); CMakeLists.txt honours the same variable.
MANIFEST_PATH = Path(os.environ.get("COSA_BUILD_MANIFEST") or ROOT / "csrc" / "build_manifest.json")
MANIFEST = json.loads(MANIFEST_PATH.read_text())


def log(message: str) -> None:
    print(f"cosa setup: {message}", file=sys.stderr, flush=True)


def repo_path(path: str) -> str:
    """A manifest path as setuptools wants it: relative to the repository root when inside it."""
    full = (ROOT / path).resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else str(full)


def kernel_sources() -> list[str]:
    suffixes = tuple(MANIFEST["kernel_source_suffixes"])
    found = []
    for folder in MANIFEST["kernel_source_dirs"]:
        base = ROOT / folder
        found += [repo_path(str(p)) for p in base.rglob("*") if p.is_file() and p.name.endswith(suffixes)]
    return sorted(found)


def arch_list_names_hopper(arch_list: str) -> bool:
    entries = [e.strip() for e in re.split(r"[;,\s]+", arch_list) if e.strip()]
    return any(e.removesuffix("+PTX") in ("9.0", "9.0a", "Hopper") for e in entries)


def choose_cuda() -> tuple[bool, str]:
    """Whether to compile the CUDA sources, and why (one line for the build log)."""
    if os.environ.get("COSA_FORCE_CPU", "0") not in ("", "0"):
        return False, "COSA_FORCE_CPU is set"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is not a CUDA build"
    if CUDA_HOME is None or not Path(CUDA_HOME, "bin", "nvcc").exists():
        return False, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list is None:
        if torch.cuda.is_available() and any(
            torch.cuda.get_device_capability(i) == (9, 0) for i in range(torch.cuda.device_count())
        ):
            return True, "TORCH_CUDA_ARCH_LIST is unset and a Hopper GPU is visible"
        return False, "TORCH_CUDA_ARCH_LIST is unset and no Hopper GPU is visible (set TORCH_CUDA_ARCH_LIST=9.0)"
    if not arch_list_names_hopper(arch_list):
        return False, f"TORCH_CUDA_ARCH_LIST={arch_list!r} does not name 9.0 (the kernels are Hopper-only)"
    return True, f"TORCH_CUDA_ARCH_LIST={arch_list!r} names 9.0, torch {torch.__version__}, nvcc in {CUDA_HOME}"


def cutlass_include() -> str:
    """The CUTLASS/CuTe header folder (third_party/cutlass_headers.py), or the build stops saying why."""
    found = cutlass_headers.cutlass_include()
    if found is not None:
        return str(found)
    candidate = cutlass_headers.cutlass_include_candidate()
    where = f" ({candidate} has no cute/tensor.hpp)" if candidate is not None else ""
    sys.exit(
        "cosa setup: error: the CUDA build needs the CUTLASS/CuTe headers"
        f"{where}: run `pip install nvidia-cutlass` or set CUTLASS_DIR to a CUTLASS checkout "
        "(or build CPU-only with COSA_FORCE_CPU=1)"
    )


def pip_cuda_includes() -> list[str]:
    """Header folders of the pip CUDA packages that torch depends on. torch's CUDAContext.h includes
    cusparse.h and cublas_v2.h, which a minimal CUDA toolkit may lack; these folders go after the
    toolkit's own so that they only fill what it misses."""
    try:
        import nvidia
    except ImportError:
        return []
    folders = []
    for base in map(Path, nvidia.__path__):
        for layout in ("cu13/include", "cu12/include", "cusparse/include", "cublas/include", "cusolver/include"):
            if (base / layout).is_dir():
                folders.append(str(base / layout))
    return folders


# Beside the compiled extension: the torch it was compiled against. An extension is bound to the C++
# ABI of that torch; cosa/__init__.py compares this with the torch that imports it.
TORCH_VERSION_FILE = "_C.torch-version"


class BuildExtensionRecordingTorch(BuildExtension):
    def run(self):
        super().run()
        # setuptools builds into the build folder and, for an in-place or editable build, copies the
        # extension into the source tree: the record goes beside both.
        inplace = self.inplace
        for self.inplace in dict.fromkeys((False, inplace)):
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).with_name(TORCH_VERSION_FILE).write_text(torch.__version__ + "\n")
        self.inplace = inplace


def extension():
    use_cuda, reason = choose_cuda()
    include_dirs = [str(ROOT / d) for d in MANIFEST["include_dirs"]]
    sources = [repo_path(s) for s in MANIFEST["binding_sources"]]
    cxx_flags = list(MANIFEST["cxx_flags"])
    jobs = os.environ.get("MAX_JOBS", "ninja's default")
    if not use_cuda:
        log(f"building the CPU-only extension (op schemas and argument checks; the CPU kernels are the Python "
            f"reference): {reason}")
        return CppExtension("cosa._C", sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx_flags}, py_limited_api=True)
    sources += [repo_path(s) for s in MANIFEST["binding_cuda_sources"]]
    kernels = kernel_sources()
    if not kernels:
        sys.exit(f"cosa setup: error: no kernel sources ({MANIFEST['kernel_source_suffixes']}) "
                 f"under {MANIFEST['kernel_source_dirs']} (manifest {MANIFEST_PATH})")
    log(f"building the CUDA extension for sm_90a ({len(kernels)} kernel sources, MAX_JOBS={jobs}): {reason}")
    ext = CUDAExtension(
        "cosa._C",
        sources + kernels,
        include_dirs=include_dirs + [cutlass_include()],
        extra_compile_args={"cxx": cxx_flags + ["-DCOSA_WITH_CUDA"], "nvcc": list(MANIFEST["nvcc_flags"])},
        py_limited_api=True,
    )
    ext.include_dirs += pip_cuda_includes()
    return ext


setup(
    name="cosa",
    version=MANIFEST["version"],
    description="Training-free block-sparse attention prefill (KAP + OSK) for NVIDIA Hopper",
    packages=find_packages(include=["cosa", "cosa.*"]),
    license="BSD-3-Clause",
    python_requires=">=3.10",
    # The torch the extension is compiled against, exactly (a wheel built here is for that torch alone).
    install_requires=[f"torch=={torch.__version__.partition('+')[0]}"],
    # What the test suite needs beyond the package: `pip install --no-build-isolation ".[test]"`.
    extras_require={"test": ["pytest", "numpy", "transformers>=4.48,<6"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtensionRecordingTorch},
    # vLLM loads every installed general plugin at start-up: this one only registers CoSA's backend
    # in the CUSTOM slot (cosa/integrations/vllm_plugin.py), which an engine uses when asked to.
    entry_points={"vllm.general_plugins": ["cosa = cosa.integrations.vllm_plugin:register"]},
    # The extension uses only the stable CPython ABI (its module init), so one wheel serves every
    # Python from 3.10 on; torch defines Py_LIMITED_API for py_limited_api extensions itself.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
