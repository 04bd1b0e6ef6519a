"""The op kind of a module, by what it computes: shared by ``convert``, ``summary`` and ``profile``."""

from __future__ import annotations

from torch import nn

__all__ = ["is_hf_conv1d", "kind_of"]

_BY_TYPE: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "linear"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.LayerNorm, "layernorm"),
    (nn.RMSNorm, "rmsnorm"),
    (nn.GroupNorm, "norm"),
    (nn.modules.batchnorm._BatchNorm, "norm"),
    (nn.MultiheadAttention, "attention"),
    (nn.Softmax, "softmax"),
    (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding"),
    (nn.GELU, "activation"),
    (nn.ReLU, "activation"),
    (nn.SiLU, "activation"),
    (nn.Tanh, "activation"),
    (nn.Sigmoid, "activation"),
    (nn.modules.loss._Loss, "loss"),
)


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 family): a Linear with its weight stored ``[in, out]``."""
    return any(
        c.__name__ == "Conv1D" and c.__module__.startswith("transformers.") for c in type(module).__mro__
    )


def kind_of(module: nn.Module) -> str:
    """``"linear"``, ``"layernorm"``, ``"attention"``, ... or ``"other"``."""
    for cls, kind in _BY_TYPE:
        if isinstance(module, cls):
            return kind
    if is_hf_conv1d(module):
        return "linear"
    name = type(module).__name__
    if "Attention" in name:
        return "attention"
    if name.endswith(("LayerNorm", "RMSNorm")):
        return "layernorm" if name.endswith("LayerNorm") else "rmsnorm"
    if type(module).__module__.startswith("transformers.activations"):
        return "activation"
    return "other"
