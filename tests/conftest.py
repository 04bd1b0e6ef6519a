import os
import sys

import pytest
import torch

# Triton kernels are tested on CPU through Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Helpers shared by the test files (tests/_harness.py) are importable as a top-level module.
sys.path.insert(0, os.path.dirname(__file__))
