"""One ``torch.autograd.Function`` per op family, each keeping only compressed tensors for backward."""

from slimact.functional.activation import activation
from slimact.functional.attention import scaled_dot_product_attention, softmax_dropout_matmul
from slimact.functional.batch_norm import batch_norm
from slimact.functional.conv import conv
from slimact.functional.dropout import dropout
from slimact.functional.linear import linear
from slimact.functional.lm_loss import linear_cross_entropy
from slimact.functional.matmul import matmul
from slimact.functional.mlp import gated_mlp
from slimact.functional.norm import group_norm, norm
from slimact.functional.softmax import softmax

__all__ = [
    "activation",
    "batch_norm",
    "conv",
    "dropout",
    "gated_mlp",
    "group_norm",
    "linear",
    "linear_cross_entropy",
    "matmul",
    "norm",
    "scaled_dot_product_attention",
    "softmax",
    "softmax_dropout_matmul",
]
