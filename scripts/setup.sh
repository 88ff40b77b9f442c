#!/usr/bin/env bash
# One-step set-up from a clone, into the current Python environment (a virtual environment: a
# system Python that forbids pip installs, PEP 668, is refused up front with the commands to make one):
#   torch (only when none is installed), the build tools, the CUTLASS headers (unless CUTLASS_DIR
#   names a CUTLASS checkout), transformers (for the integration and the model-level benches), then
#   cosa itself as an editable install so that `python -m cosa.demo` and the tests run from the
#   repository root.
# The CUDA kernels are compiled for sm_90a whenever torch is a CUDA build and nvcc is found (no GPU
# needed to compile); otherwise the package installs with its CPU path (the reference).
# A previous build is reused when no build input changed since it started and torch and the build
# settings are the same (both recorded in cosa/_C.build-stamp). The last line says which build cosa
# has: the CUDA kernels, or the CPU path only and why.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${COSA_TORCH_VERSION:-2.14.1}

# pip refuses to install into a Python that the system manages (PEP 668: an EXTERNALLY-MANAGED file
# beside its standard library), after a few seconds and in words that do not say what to do here.
if "$PYTHON" -c 'import sys, sysconfig, pathlib
sys.exit(not (sys.prefix == sys.base_prefix
              and (pathlib.Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").is_file()))'; then
  echo "cosa setup.sh: $("$PYTHON" -c 'import sys; print(sys.executable)') is the system's Python, which pip" \
    "may not install into (PEP 668). Make a virtual environment and run this again from it:" >&2
  echo "  python3 -m venv .venv && source .venv/bin/activate" >&2
  exit 1
fi

missing=()
"$PYTHON" -c "import torch" 2>/dev/null || missing+=("torch==${TORCH_VERSION}")
modules=(ninja:ninja numpy:numpy pytest:pytest setuptools:setuptools wheel:wheel "transformers:transformers>=4.48,<6")
[[ -n ${CUTLASS_DIR:-} ]] || modules+=(cutlass_library:nvidia-cutlass)
for module_package in "${modules[@]}"; do
  "$PYTHON" -c "import ${module_package%%:*}" 2>/dev/null || missing+=("${module_package#*:}")
done
if ((${#missing[@]})); then
  echo "cosa setup.sh: installing ${missing[*]}"
  "$PYTHON" -m pip install "${missing[@]}"
fi

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

STAMP=cosa/_C.build-stamp
LOG=build/setup-sh.log
# The build's input files. Bytecode caches are not inputs (the build itself imports
# third_party/cutlass_headers.py, which writes one after the stamp's time), and only files count:
# writing that cache changes its folder's time too.
build_inputs() {
  find csrc setup.py CMakeLists.txt pyproject.toml cosa/defaults.py cosa/tuning.py third_party -name __pycache__ -prune \
    -o -type f "$@" -print
}
# What decides the build besides its input files' contents: which files they are (a source added or
# removed), torch, and the variables setup.py and torch's extension builder read to choose the CUDA
# or the CPU-only build and to find nvcc and CUTLASS.
settings="input files $(build_inputs | LC_ALL=C sort | cksum)
torch $("$PYTHON" -c 'import torch; print(torch.__version__)')
nvidia-cutlass $("$PYTHON" -c 'import importlib.metadata as m
try: print(m.version("nvidia-cutlass"))
except m.PackageNotFoundError: print("none")')
nvcc on PATH: $(command -v nvcc || echo none)"
for name in TORCH_CUDA_ARCH_LIST COSA_FORCE_CPU COSA_BUILD_MANIFEST CUDA_HOME CUDA_PATH CUTLASS_DIR; do
  settings+=$'\n'"${name}=${!name:-}"
done

shopt -s nullglob
extension=(cosa/_C*.so)
shopt -u nullglob

# The stamp's time is the start of the build that wrote it: an input edited during that build is
# newer than the stamp, so the next run builds again.
build_is_current() {
  ((${#extension[@]})) && [[ -f $STAMP ]] &&
    [[ "$(grep -v '^cosa setup: ' "$STAMP")" == "$settings" ]] &&
    [[ -z "$(build_inputs -newer "$STAMP" | head -n 1)" ]]
}

# pip -v streams the build's output; ninja prints "[n/m] <command>" as each compile finishes. Shows
# those as progress lines (the source file and the time since the build started), and setup.py's
# choice of build once.
show_progress() {
  local line source step_re='^ *\[([0-9]+)/([0-9]+)\] ' choice_shown=""
  while IFS= read -r line; do
    if [[ -z $choice_shown && $line == *"cosa setup: building "* ]]; then
      echo "cosa setup.sh: ${line#*cosa setup: }"
      choice_shown=1
    elif [[ $line =~ $step_re ]]; then
      source=${line##* -c }
      source=${source%% *}
      echo "cosa setup.sh: [${BASH_REMATCH[1]}/${BASH_REMATCH[2]}] compiled ${source#"$PWD/"}" \
        "($((SECONDS - build_start)) s)"
    fi
  done
}

if build_is_current; then
  echo "cosa setup.sh: reusing ${extension[0]} (no build input changed since it was built, same torch and settings)"
else
  mkdir -p build
  started=$(mktemp)
  trap 'rm -f "$started"' EXIT
  echo "cosa setup.sh: building cosa (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}, MAX_JOBS=${MAX_JOBS});" \
    "the CUDA kernels take about 2-3 minutes to compile on 2 cores; the build log is $LOG"
  rm -f "$STAMP"
  build_start=$SECONDS
  if ! "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee "$LOG" | show_progress; then
    echo "cosa setup.sh: the build failed; its first error lines, then the end of $LOG:" >&2
    grep -m 40 -E "error|Error" "$LOG" >&2 || true
    echo "   ..." >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  # setup.py prints its choice (CUDA or CPU-only, and why) as one "cosa setup: building ..." line.
  { echo "$settings"; grep -o 'cosa setup: building .*' "$LOG" | tail -n 1; } > "$STAMP"
  touch -r "$started" "$STAMP"
  echo "cosa setup.sh: built in $((SECONDS - build_start)) s"
fi

COSA_BUILD_CHOICE=$(grep '^cosa setup: ' "$STAMP" || true) COSA_BUILD_LOG=$LOG "$PYTHON" - <<'EOF'
import os
import sys

import torch

import cosa

# setup.py's line: "cosa setup: building the CUDA extension ... (...): <why>" or "... CPU-only ...".
choice = os.environ["COSA_BUILD_CHOICE"]
if not cosa._C_AVAILABLE:
    sys.exit(f"cosa setup.sh: cosa imports, but its compiled extension does not load: {cosa._C_IMPORT_ERROR}")
if torch._C._dispatch_has_kernel_for_dispatch_key("cosa::prefill", "CUDA"):
    print(f"cosa setup.sh: cosa is built with the CUDA kernels for sm_90a ({cosa._C.__file__})")
elif "the CUDA extension" in choice:
    sys.exit("cosa setup.sh: setup.py compiled the CUDA sources, yet torch.ops.cosa.prefill has no CUDA kernel")
else:
    reason = choice.partition("): ")[2] or f"setup.py's reason is in {os.environ['COSA_BUILD_LOG']}"
    print(f"cosa setup.sh: cosa is built with the CPU path only (the PyTorch reference serves the ops): {reason}")
EOF
