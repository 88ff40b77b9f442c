import pytest
import torch


def _hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ops():
    """torch.ops.cosa, failing (not skipping) when the extension was not built: a missing build is a bug."""
    import cosa

    if not cosa._C_AVAILABLE:
        pytest.fail(f"cosa._C is not importable ({cosa._C_IMPORT_ERROR}); install the package first (README)")
    return torch.ops.cosa
