"""The op kind of a module, by what it computes: shared by ``convert``, ``summary`` and ``profile``.

Activation modules are recognised by evaluating them on a probe vector and comparing with the known forms
(:data:`slimact.functional.activation.FORMS`), so a model's own class (Hugging Face's
``NewGELUActivation``, ``GELUTanh``, ``QuickGELUActivation``, a user's ``Swish``) is found by its math,
not its name.
"""

from __future__ import annotations

import re
import weakref

import torch
from torch import nn

__all__ = ["activation_form", "is_hf_conv1d", "kind_of", "norm_form"]

_BY_TYPE: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "linear"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.LayerNorm, "layernorm"),
    (nn.RMSNorm, "rmsnorm"),
    (nn.GroupNorm, "norm"),
    (nn.modules.batchnorm._BatchNorm, "batchnorm"),
    (nn.MultiheadAttention, "attention"),
    (nn.Softmax, "softmax"),
    (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding"),
    (nn.modules.loss._Loss, "loss"),
)

_FORM_KIND = {"gelu": "gelu", "gelu_tanh": "gelu", "quick_gelu": "gelu", "silu": "silu", "relu": "relu"}
_ACTIVATION_NAME = re.compile(r"gelu|silu|swish|relu|act", re.IGNORECASE)
_PROBE = torch.linspace(-8.0, 8.0, 321)
_forms: weakref.WeakKeyDictionary[nn.Module, str | None] = weakref.WeakKeyDictionary()


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 family): a Linear with its weight stored ``[in, out]``."""
    return any(
        c.__name__ == "Conv1D" and c.__module__.startswith("transformers.") for c in type(module).__mro__
    )


def _looks_like_activation(module: nn.Module) -> bool:
    cls = getattr(module, "_slimact_orig_cls", type(module))
    if next(module.children(), None) is not None or next(module.parameters(), None) is not None:
        return False
    if next(module.buffers(), None) is not None and not any(n.startswith("_slimact_") for n in module._buffers):
        return False
    return (
        cls.__module__.startswith(("torch.nn.modules.activation", "transformers.activations"))
        or bool(_ACTIVATION_NAME.search(cls.__name__))
    )


def activation_form(module: nn.Module) -> str | None:
    """``"gelu"``, ``"gelu_tanh"``, ``"quick_gelu"``, ``"silu"`` or ``"relu"`` if ``module`` computes that
    activation (to fp32 rounding on [-8, 8]), else ``None``."""
    if module in _forms:
        return _forms[module]
    from slimact.functional.activation import FORMS, reference

    form = None
    if _looks_like_activation(module):
        cls = getattr(module, "_slimact_orig_cls", type(module))
        try:
            with torch.no_grad():
                y = cls.forward(module, _PROBE.clone()).double()
        except Exception:  # a module that cannot run on a plain vector is not a pointwise activation
            y = None
        if y is not None and y.shape == _PROBE.shape:
            for candidate in FORMS:
                ref = reference(candidate, _PROBE.double())
                if torch.allclose(y, ref, rtol=1e-5, atol=2e-6):
                    form = candidate
                    break
    _forms[module] = form
    return form


_norm_forms: weakref.WeakKeyDictionary[nn.Module, dict | None] = weakref.WeakKeyDictionary()


def _probe_norm(module: nn.Module, cls: type, weight: torch.Tensor, eps: float) -> dict | None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, weight.numel(), generator=gen) * 3 + 1
    y = None
    for dtype in (torch.float32, weight.dtype):  # fp32 first; a module that insists on its own dtype next
        try:
            with torch.no_grad():
                y = cls.forward(module, x.to(dtype)).float()
            break
        except Exception:  # not a plain [..., C] -> [..., C] norm in this dtype
            continue
    if y is None:
        return None
    x = x.to(dtype).float()
    tol = max(1e-3, 4 * torch.finfo(dtype).eps)
    xf, w = x.float(), weight.detach().float()
    bias = getattr(module, "bias", None)
    b = bias.detach().float() if isinstance(bias, torch.Tensor) else 0.0
    rms = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    var, mean = torch.var_mean(xf, -1, unbiased=False, keepdim=True)
    centered = (xf - mean) * torch.rsqrt(var + eps)
    candidates = [(centered, True, 0.0), (rms, False, 0.0), (rms, False, 1.0)]
    for xn, is_centered, offset in candidates:
        if y.shape == xn.shape and torch.allclose(y, xn * (w + offset) + b, rtol=tol, atol=tol / 10):
            return {"centered": is_centered, "offset": offset, "eps": eps}
    return None


def norm_form(module: nn.Module) -> dict | None:
    """``{"centered", "offset", "eps"}`` if ``module`` is a LayerNorm (centered) or an RMSNorm (Gemma's
    ``1 + weight``: ``offset=1``) over its last dim, by what it computes; else ``None``."""
    if module in _norm_forms:
        return _norm_forms[module]
    cls = getattr(module, "_slimact_orig_cls", type(module))
    form = None
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        if len(module.normalized_shape) == 1:
            form = {"centered": isinstance(module, nn.LayerNorm), "offset": 0.0, "eps": module.eps}
    elif "Norm" in cls.__name__ and next(module.children(), None) is None:
        weight = getattr(module, "weight", None)
        eps = next((getattr(module, a) for a in ("eps", "variance_epsilon", "epsilon") if hasattr(module, a)), None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 1 and isinstance(eps, float):
            form = _probe_norm(module, cls, weight, eps)
    _norm_forms[module] = form
    return form


def kind_of(module: nn.Module) -> str:
    """``"linear"``, ``"layernorm"``, ``"gelu"``, ``"attention"``, ... or ``"other"``."""
    kind = getattr(module, "_slimact_kind", None)
    if kind is not None:
        return kind
    form = norm_form(module)
    if form is not None:
        return "layernorm" if form["centered"] else "rmsnorm"
    if all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) or all(
        isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_up_proj", "down_proj")
    ):  # a gated MLP: separate gate and up projections, or fused (Phi-3)
        return "mlp"
    for cls, kind in _BY_TYPE:
        if isinstance(module, cls):
            return kind
    if is_hf_conv1d(module):
        return "linear"
    from slimact.nn.matmul import MatMulBase

    if isinstance(module, MatMulBase):
        return "matmul"
    name = type(module).__name__
    if "Attention" in name:
        return "attention"
    if name.endswith("LayerNorm"):
        return "layernorm"
    if name.endswith("RMSNorm"):
        return "rmsnorm"
    form = activation_form(module)
    if form is not None:
        return _FORM_KIND[form]
    if _looks_like_activation(module):
        return "activation"
    return "other"
