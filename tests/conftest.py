import os
import sys

import pytest

# Under pytest-xdist, each worker gets its share of the cores: PyTorch's intra-op pool otherwise starts one
# thread per core in every worker, and oversubscribed OpenMP threads spin against each other (the quick demo took
# 5x its time alone). Subprocesses the tests start (torchrun, fresh interpreters) inherit the setting.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

import torch

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton kernels are tested on CPU through Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Helpers shared by the test files (tests/_harness.py) are importable as a top-level module.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(items):
    # The long tests first (marked slow), the rest in their order: started last, one of them kept a worker busy
    # for a minute after the other had finished (make test's run took 150 s longer than its work split in two).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
