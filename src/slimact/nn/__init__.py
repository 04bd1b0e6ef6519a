"""Drop-in modules: each subclasses the torch module it replaces and keeps compressed tensors for backward."""

from slimact.nn._base import SlimModule
from slimact.nn.activation import GELU, ReLU, SiLU
from slimact.nn.batch_norm import BatchNorm2d
from slimact.nn.conv import Conv2d
from slimact.nn.dropout import Dropout
from slimact.nn.linear import Linear
from slimact.nn.matmul import MatMul, MatMulBase
from slimact.nn.norm import GroupNorm, LayerNorm, RMSNorm
from slimact.nn.softmax import Softmax

__all__ = [
    "GELU",
    "BatchNorm2d",
    "Conv2d",
    "Dropout",
    "GroupNorm",
    "LayerNorm",
    "Linear",
    "MatMul",
    "MatMulBase",
    "RMSNorm",
    "ReLU",
    "SiLU",
    "SlimModule",
    "Softmax",
]
