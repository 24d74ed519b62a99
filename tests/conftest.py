import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import torch

    if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # pytest -n: the cores shared among the workers, not each taking them all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    """``triton_on_cpu``: the test runs the Triton kernels on CPU tensors, which only the
    interpreter can do. On a GPU machine (no TRITON_INTERPRET) those tests skip; the kernels are
    tested there at real shapes on the GPU (tests/test_kernels_*.py, scripts/gpu_check.py)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (set by conftest only without CUDA)")
    for item in items:
        if "triton_on_cpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """The random test model and the demo's quantized copies are generated into a per-session cache, never the user's."""
    if "MOESERVE_CACHE" not in os.environ:
        os.environ["MOESERVE_CACHE"] = str(tmp_path_factory.mktemp("moeserve-cache"))
    yield


@pytest.fixture(scope="session")
def v3_checkpoint(tmp_path_factory):
    from checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v3", "v3_qlora_grouped_yarn")


@pytest.fixture(scope="session")
def v2_checkpoint(tmp_path_factory):
    from checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v2", "v2_greedy_yarn")


@pytest.fixture(scope="session")
def fp8_checkpoint(tmp_path_factory):
    """(DeepSeek-V3-style FP8 checkpoint, its dequantized plain twin): tests/fp8_checkpoints.py."""
    from fp8_checkpoints import make_fp8_checkpoint

    return make_fp8_checkpoint(tmp_path_factory.mktemp("fp8"))
