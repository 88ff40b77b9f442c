#!/usr/bin/env bash
# One-step set-up from a clone, into the current Python environment:
#   torch (only when none is installed), the build tools, the CUTLASS headers, transformers (for the
#   integration and the model-level benches), then cosa itself as an
#   editable install so that `python -m cosa.demo` and the tests run from the repository root.
# The CUDA kernels are compiled for sm_90a whenever torch is a CUDA build and nvcc is found (no GPU
# needed to compile); otherwise the package installs with its CPU path (the reference).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${COSA_TORCH_VERSION:-2.14.1}

missing=()
"$PYTHON" -c "import torch" 2>/dev/null || missing+=("torch==${TORCH_VERSION}")
for module_package in ninja:ninja numpy:numpy pytest:pytest cutlass_library:nvidia-cutlass setuptools:setuptools \
    wheel:wheel "transformers:transformers>=4.48,<6"; do
  "$PYTHON" -c "import ${module_package%%:*}" 2>/dev/null || missing+=("${module_package#*:}")
done
if ((${#missing[@]})); then
  echo "cosa setup.sh: installing ${missing[*]}"
  "$PYTHON" -m pip install "${missing[@]}"
fi

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
echo "cosa setup.sh: building cosa (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}, MAX_JOBS=${MAX_JOBS})"
"$PYTHON" -m pip install --no-build-isolation --no-deps -e .
