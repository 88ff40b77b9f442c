"""Where the CUTLASS/CuTe headers are, for the Python-side builds (setup.py, dev/kernel_ab.py); the
CMake build follows the same rule in CMakeLists.txt. Plain Python, no imports beyond the standard
library (and nvidia-cutlass where installed), so that it runs before torch or the extension exist."""

from __future__ import annotations

import os
from pathlib import Path


def cutlass_include_candidate() -> Path | None:
    """$CUTLASS_DIR/include, else the nvidia-cutlass pip package's header folder; None if neither."""
    if os.environ.get("CUTLASS_DIR"):
        return Path(os.environ["CUTLASS_DIR"]) / "include"
    try:
        import cutlass_library
    except ImportError:
        return None
    return Path(cutlass_library.__file__).parent / "source" / "include"


def cutlass_include() -> Path | None:
    """The candidate folder if it holds the CuTe headers (cute/tensor.hpp), else None."""
    folder = cutlass_include_candidate()
    return folder if folder is not None and (folder / "cute" / "tensor.hpp").exists() else None
