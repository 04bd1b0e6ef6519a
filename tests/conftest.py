import os

import pytest
import torch

# Triton kernels are tested on CPU through Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
