"""Installing cosa as a new user would: the build's refusals (pip's default build isolation), the
wheel's torch requirement, the check that the extension was built for the torch importing it,
whether the CUDA kernels can run here, and scripts/setup.sh reusing its build on a second run."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import cosa

ROOT = Path(__file__).resolve().parents[1]
# What setup.py and scripts/setup.sh read: a copy of these builds like the repository.
BUILD_INPUTS = ["setup.py", "pyproject.toml", "CMakeLists.txt", "MANIFEST.in", "cosa", "csrc", "third_party", "scripts"]


def copy_build_inputs(destination: Path) -> Path:
    destination.mkdir(parents=True, exist_ok=True)
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "_C.build-stamp", "_C.torch-version"))
        else:
            shutil.copy2(source, destination / name)
    return destination


def test_an_isolated_build_stops_at_once_naming_no_build_isolation(tmp_path):
    """pip's default build isolation hides the environment's torch and CUTLASS headers: the build stops
    before it downloads or compiles anything, saying to use --no-build-isolation. Simulated with
    `python -S` (no site-packages on sys.path, as under isolation)."""
    copy_build_inputs(tmp_path)
    result = subprocess.run([sys.executable, "-S", "setup.py", "--version"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert "cosa setup: error: this build runs isolated from the Python environment" in result.stderr
    assert "pip install --no-build-isolation ." in result.stderr


def test_pyproject_does_not_ask_an_isolated_build_for_torch():
    """A torch in build-system.requires would make an isolated build download torch (gigabytes) only to
    be refused, or compile against a torch other than the one that will import the extension."""
    requires = re.search(r"^requires\s*=\s*\[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    names = [re.split(r"[\s<>=!~;\[]", item.strip().strip("\"'"))[0] for item in requires.group(1).split(",")]
    assert "setuptools" in names and "torch" not in names


def test_the_package_requires_the_torch_it_is_built_against(tmp_path):
    """The wheel's metadata pins torch to the version the extension is compiled against."""
    copy_build_inputs(tmp_path)
    env = dict(os.environ, COSA_FORCE_CPU="1")
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=tmp_path,
                   env=env, check=True, capture_output=True, timeout=120)
    requires = (tmp_path / "cosa.egg-info" / "requires.txt").read_text().split("\n\n")[0].split()
    assert requires == [f"torch=={torch.__version__.partition('+')[0]}"]


def test_an_extension_built_for_another_torch_is_refused_naming_both(tmp_path):
    extension = tmp_path / "_C.abi3.so"
    assert cosa.torch_mismatch(extension) is None  # nothing recorded (an older build): not refused
    (tmp_path / "_C.torch-version").write_text("2.14.1+cu130\n")
    assert cosa.torch_mismatch(extension, "2.14.1+cu130") is None
    why = cosa.torch_mismatch(extension, "2.15.0+cu130")
    assert "was built for torch 2.14.1+cu130, and this Python has torch 2.15.0+cu130" in why
    assert "--no-build-isolation" in why and "scripts/setup.sh" in why


def test_import_warns_and_leaves_out_an_extension_built_for_another_torch(tmp_path):
    """At import, not at the first call of torch.ops.cosa: a copy of the package whose record names
    another torch imports with a warning naming both, and without the extension."""
    if not cosa._C_AVAILABLE:
        pytest.fail(f"cosa._C is not importable ({cosa._C_IMPORT_ERROR})")
    package = Path(cosa.__file__).parent
    copy = shutil.copytree(package, tmp_path / "cosa", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(cosa._C.__file__, copy)
    (copy / "_C.torch-version").write_text("0.0.1\n")
    result = subprocess.run([sys.executable, "-c", "import cosa; print(cosa._C_AVAILABLE)"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert f"RuntimeWarning: cosa: torch.ops.cosa is not available: the compiled extension {copy}" in result.stderr
    assert f"was built for torch 0.0.1, and this Python has torch {torch.__version__}" in result.stderr


def test_the_built_extension_records_this_torch():
    """The build under test wrote the torch it compiled against beside the extension, and it matches."""
    if not cosa._C_AVAILABLE:
        pytest.fail(f"cosa._C is not importable ({cosa._C_IMPORT_ERROR})")
    record = Path(cosa._C.__file__).with_name("_C.torch-version")
    assert record.read_text().strip() == torch.__version__


def test_cuda_kernels_are_available_only_where_a_hopper_gpu_runs_them(monkeypatch):
    """Kernels compiled for sm_90a (possible without a GPU) are not available without a Hopper GPU."""
    monkeypatch.setattr(cosa, "cuda_kernels_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cosa.cuda_kernels_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    assert not cosa.cuda_kernels_available()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    assert cosa.cuda_kernels_available()
    monkeypatch.setattr(cosa, "cuda_kernels_built", lambda: False)
    assert not cosa.cuda_kernels_available()


def test_setup_sh_refuses_a_system_python_with_the_venv_commands(tmp_path):
    """A Python that the system manages (PEP 668) gets the commands to make a virtual environment, not
    pip's error after a few seconds. This interpreter plays one: a sitecustomize module makes it look
    like no virtual environment, with an EXTERNALLY-MANAGED marker beside its standard library."""
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    (stdlib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\n")
    (tmp_path / "sitecustomize.py").write_text(f"""import sys, sysconfig
sys.base_prefix = sys.prefix
_get_path = sysconfig.get_path
sysconfig.get_path = lambda name, *args, **kwargs: {str(stdlib)!r} if name == "stdlib" else _get_path(name, *args, **kwargs)
""")
    copy = copy_build_inputs(tmp_path / "repo")
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(tmp_path))
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=copy, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "which pip may not install into (PEP 668)" in result.stderr
    assert "python3 -m venv .venv && source .venv/bin/activate" in result.stderr
    assert not (copy / "build").exists()  # stopped before anything else


def test_setup_sh_reuses_its_build_on_a_second_run(tmp_path):
    """Each README command starts with scripts/setup.sh: on a copy of the repository, the first run
    builds (CPU-only here, to keep it short), the second, with nothing changed, reuses that build.
    Python writes bytecode caches as on a new user's machine (the build imports
    third_party/cutlass_headers.py, whose cache once made every run build again)."""
    copy = copy_build_inputs(tmp_path / "repo")
    # A virtual environment that sees this one's packages (torch, the build tools) and installs cosa
    # into itself, not into the environment running the tests.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    Path(venv_site, "outer-environment.pth").write_text(
        "\n".join(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # The outer environment's scripts (ninja, whose "[n/m]" lines are the build's progress) on PATH.
    env.update(PYTHON=str(python), COSA_FORCE_CPU="1", MAX_JOBS="1",
               PATH=os.pathsep.join([sysconfig.get_paths()["scripts"], env.get("PATH", "")]))

    def setup_sh():
        result = subprocess.run(["bash", "scripts/setup.sh"], cwd=copy, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    first = setup_sh()
    assert "cosa setup.sh: building cosa" in first and "cosa setup.sh: built in " in first
    assert re.search(r"cosa setup\.sh: \[1/\d+\] compiled csrc/", first)  # the build's progress
    assert list((copy / "third_party").glob("__pycache__/*.pyc")), "no bytecode written: the check cannot fail"
    second = setup_sh()
    assert "cosa setup.sh: reusing " in second and "building" not in second
    assert "cosa is built with the CPU path only" in second
