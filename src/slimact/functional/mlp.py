"""Gated MLP (SwiGLU, GeGLU: Llama, Mistral, Qwen, Gemma) keeping only its gate and up projections.

Math, with ``g = x W_g^T``, ``u = x W_u^T`` (the gate and up projections, computed by the block's own Linears)::

    a = act(g),   h = a * u,   y = h W_d^T + b_d
    grad_W_d = grad_y^T h,   grad_h = grad_y W_d,   grad_u = grad_h * a,   grad_g = grad_h * u * act'(g)

Plain PyTorch keeps four ``[tokens, intermediate]`` tensors here: ``g`` (the activation's input), ``a`` and
``u`` (the product's inputs) and ``h`` (the down projection's input). This Function keeps ``g`` and ``u`` only
(exact under a lossless policy, 1 byte per element each at 8 bits) and recomputes ``a`` and ``h`` in the
backward, ``h`` also for the down projection's weight gradient. The forward is the block's own arithmetic
(its activation module, then the product, then ``F.linear``): identical output.

At 8 bits ``g`` is kept through its codes of ``c = K asinh(g / K)`` (``K = 4``; restored as ``K sinh(c)``),
``u`` through its own. ``g`` is wide where a model is trained (a gate pre-activation of std 22 and magnitude 87
after a norm with large-weight channels), and a uniform step over that range (0.7) blurs ``act'(g)`` where the
activation bends, ``|g| < 5``: the gate weight's gradient fell to 25-29 dB per layer (to 18-24 dB over a whole
model), where keeping ``act(g)`` and ``h`` apart as the unfused layers do gives 34. The code ``c`` is ``g`` itself
within a few percent for ``|g| < K`` and logarithmic beyond it, so the restore error is about uniform near 0 and
relative (a constant fraction of ``|g|``, as a float's) on the tails: on narrow data (``|g| < 4``) nothing
changes, on those trained-like layers the gate weight's gradient is 35-41 dB (``tests/functional/test_mlp.py``).
A standalone activation clips its kept input instead (its derivative is flat out there); the block also needs
``act(g)`` itself there, which is not flat. ``c`` (fp32; fp16 for an fp16 ``g``) is written where the forward's
product was, after the down projection read it (for a bf16 ``g``, which has no room for it, into a transient).
Where ``g`` has a heavy tail that its own pack keeps apart as outliers (exactly), that pack is kept instead
(:func:`_pack_gate`): ``c`` would fold the tail into the range. The trade: where all of ``g`` lies far beyond
``K`` (std 1e4, no tail), up_proj's and down_proj's gradients are 5-16 dB below the uniform grid's (a review:
33 against 41 dB), the gate's 20 dB above; trained models' gates (std 14-30) are on the winning side.

Error: exact up to float rounding when ``g``, ``u`` are kept exact; at 8 bits ``u`` within half its step, ``g``
within ``cosh((|c| + e) / K) e`` for ``c`` within ``e`` (half ``c``'s step: ``sqrt(1 + (g / K)^2)`` times it, to
first order); the tests assert that bound elementwise and per-gradient SQNR floors against float64.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.functional.activation import derivative, read_in_root, reference
from slimact.quant import Packed, QuantConfig, RunningRange, inductor, pack, unpack_map

__all__ = ["gated_mlp"]


class _GatedMLPFunction(SlimFunction):
    layer = "gated MLP"

    @staticmethod
    def forward(ctx, g, u, weight, bias, act, form, cfg, state_g, state_u):
        h = act(g) * u  # [..., I]: free once y is made (autograd records nothing here), so c may be written there
        y = F.linear(h, weight, bias)
        ctx.act, ctx.form, ctx.has_bias = act, form, bias is not None
        scratch = h if _may_write_over(h, g, _c_dtype(g)) else None
        del h  # (freed here where c cannot use it)
        kept_g, ctx.companded = _pack_gate(g, cfg, state_g, scratch)
        del scratch
        ctx.g_dtype = g.dtype
        save(ctx, kept_g, pack(u, cfg, state_u), weight)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        g, u, weight = load(ctx, restore=False)
        need_g, need_u, need_w, need_b = ctx.needs_input_grad[:4]
        out = grad_y.shape[-1]
        grad_h = grad_y.matmul(weight.to(grad_y.dtype))  # [..., I]
        # At 8 bits g and u are restored inside the loop that uses them (one compiled loop reads both codes and
        # grad_h: the restored [..., I] tensors are never written, nor read back); else restored, then the loop.
        if ctx.companded:
            restored = _COMPANDED_BACKWARDS[ctx.form, ctx.g_dtype]
            otherwise = functools.partial(_expanded_backward, ctx.act, ctx.form, ctx.g_dtype)
        else:
            restored = _RESTORED_BACKWARDS[ctx.form]
            otherwise = functools.partial(_elementwise_backward, ctx.act, ctx.form)
        grad_g, grad_u, h = unpack_map((g, u), restored, grad_h.contiguous(), otherwise=otherwise)
        grad_w = grad_b = None
        if need_w:
            grad_w = grad_y.reshape(-1, out).t().matmul(h.reshape(-1, h.shape[-1]).to(grad_y.dtype))
        if ctx.has_bias and need_b:
            grad_b = grad_y.reshape(-1, out).sum(0)
        return grad_g if need_g else None, grad_u if need_u else None, grad_w, grad_b, None, None, None, None, None


#: ``c = K asinh(g / K)``: codes of c are uniform in g for ``|g| < K``, relative beyond (the module docstring). An
#: integer: a module-level float is an input of the graph under torch.compile(dynamic=True), which fails to trace
#: where two autograd.Functions read it.
_K = 4


def _asinh_scaled(g: Tensor) -> Tensor:
    # K asinh(g / K) in fp32, by log and sqrt, which vectorise (torch.asinh is a scalar loop on CPU: 20x a pack's
    # time): its series below 1e-2 (a tiny g keeps its relative precision), log(2a) where a^2 would overflow;
    # within ~1e-5 relative of asinh, far below a code.
    a = g.float().abs() * (1.0 / _K)
    near_zero = a * (1 - a * a * (1.0 / 6))
    r = torch.where(a < 1e-2, near_zero, torch.log(torch.where(a > 1e18, 2 * a, a + torch.sqrt(a * a + 1))))
    return (r * _K).copysign(g)


def _asinh_scaled_into(g: Tensor, out: Tensor) -> Tensor:
    return out.copy_(_asinh_scaled(g))


def _c_dtype(g: Tensor) -> torch.dtype:
    return torch.float16 if g.dtype == torch.float16 else torch.float32


def _may_write_over(t: Tensor, like: Tensor, dtype: torch.dtype) -> bool:
    """Whether a result of ``like``'s shape in ``dtype`` may be written over ``t``: its shape, width and device, and the
    caller's own, which it is unless a dispatch mode saw the op that made it (selective activation checkpointing keeps
    such outputs for its recompute: writing there raised "Tensor cached ... has been mutated"). While dynamo traces,
    no: inductor plans the buffers."""
    if torch.compiler.is_compiling():
        return False
    return (torch._C._len_torch_dispatch_stack() == 0 and t.shape == like.shape and t.is_contiguous()
            and t.dtype.itemsize == dtype.itemsize and t.device == like.device)


def _chunked(fn: Callable[[Tensor], Tensor], src: Tensor, out: Tensor) -> Tensor:
    """``out[:] = fn(src)`` eagerly, a sixteenth of ``src`` at a time (at least 8 Ki elements), so that the formula's
    fp32 temporaries (five alive at once) hold a third of its size, not five times it; ``out`` may be ``src``'s
    storage (each chunk is read before it is written)."""
    flat_src, flat_out = src.reshape(-1), out.view(-1)
    step = max(1 << 13, -(-flat_src.numel() // 16))
    for at in range(0, flat_src.numel(), step):
        flat_out[at : at + step] = fn(flat_src[at : at + step])
    return out


def _compand(g: Tensor, scratch: Tensor | None = None) -> Tensor:
    """``c = K asinh(g / K)``, ``[..., I]``: fp16 for an fp16 ``g`` (``|c| <= |g|``, ``c ~ g`` near 0: fp16 holds it as
    it held ``g``), else fp32: a bf16 ``c`` would round by a quarter of the 8-bit step (6 dB off up_proj's gradient),
    an fp16 one of a bf16 ``g`` loses what lies below fp16's range (gates scaled by 1e-7: up_proj's gradient 37.5 ->
    10.4 dB; 1e-9: all 0; found by review). Written over ``scratch``, where given (the forward's product ``h``, free
    by then, where :func:`_may_write_over` allows: no allocation beyond the plain block's; for a bf16 ``g`` it is too
    narrow, and ``c`` is a transient of twice ``g``'s bytes), by one compiled loop where that pays, else a chunk at a
    time."""
    dtype = _c_dtype(g)
    if torch.compiler.is_compiling():  # (inductor fuses the formula itself: no temporaries, no chunks to trace)
        return _asinh_scaled(g).to(dtype)
    out = scratch.view(dtype) if scratch is not None else torch.empty(g.shape, dtype=dtype, device=g.device)
    g = g.contiguous()
    if inductor.pays_off(g) and inductor.fused(_asinh_scaled_into, ("gated-mlp-compand", g.dtype, dtype), g,
                                               out) is not None:
        return out
    return _chunked(_asinh_scaled, g, out)


def _expand(c: Tensor, dtype: torch.dtype) -> Tensor:
    # The inverse of _compand, K sinh(c / K), back in g's dtype: by one exp (its series below 1e-2, where
    # e - 1/e cancels). A code restores within a step of c's range, so near the dtype's largest value it may
    # pass it (fp16 g of 65504: 71000 at the top code): clamped to the finite range, as g was (NaN/inf never
    # reach here: such a g is kept exact).
    y = c.float().abs() * (1.0 / _K)
    e = torch.exp(y)
    s = torch.where(y < 1e-2, y * (1 + y * y * (1.0 / 6)), (e - 1 / e) * 0.5)
    big = torch.finfo(dtype).max
    return (s * _K).clamp_(max=big).copysign(c).to(dtype)


def _expand_restored(c: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`_expand` of a restored ``c`` (the restore's own tensor) outside a compiled loop: a chunk at a time,
    written over ``c`` where it may be (fp32 over fp32, bf16 over fp16), so that restoring ``g`` holds no more than
    restoring ``g``'s own codes would (one ``g``-sized tensor, and a chunk's fp32 temporaries)."""
    if torch.compiler.is_compiling():
        return _expand(c, dtype)
    out = c.view(dtype) if _may_write_over(c, c, dtype) else torch.empty(c.shape, dtype=dtype, device=c.device)
    return _chunked(functools.partial(_expand, dtype=dtype), c, out)


def _pack_gate(g: Tensor, cfg: QuantConfig | None, state: RunningRange | None,
               scratch: Tensor | None = None) -> tuple[Packed, bool]:
    """g's pack, and whether it holds the codes of ``c`` (the module docstring) rather than of ``g``.

    A heavy tail (values beyond the outlier threshold of their group, ``QuantConfig.outliers``: a massive
    activation) is kept exactly, apart from the codes, by the pack of ``g``; in ``c`` it is compressed
    logarithmically, below that threshold, and would set the range of every other value (a 1e4 among normal
    values: a step of 0.27 near 0, against 0.024 beside the outliers kept apart). So where a pack of ``g`` can keep
    outliers apart (its own range: not a running estimate, not while dynamo traces) and does, that pack is kept,
    else ``c``'s is made (the pack of ``g`` then costs one pass more), over ``scratch`` where given. NaN/inf
    (and float64): ``g`` itself, exact (not ``sinh(asinh(g))``, which rounds)."""
    if cfg is None or g.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return pack(g, cfg, state), False
    if cfg.outliers and cfg.scale == "dynamic" and not torch.compiler.is_compiling():
        plain = pack(g, cfg, state, share=False)
        if plain.raw or len(plain.tensors) > 3:  # (codes, lo, step, index, values): outliers kept apart
            return plain, False
        del plain  # (its codes freed before c is made)
    companded = pack(_compand(g, scratch), cfg, state, share=False)
    return (pack(g, None), False) if companded.raw else (companded, True)


def _expanded_backward_eager(act: Callable[[Tensor], Tensor], form: str, dtype: torch.dtype, c: Tensor, u: Tensor,
                             grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _elementwise_backward_eager(act, form, _expand(c, dtype), u, grad_h)


def _expanded_backward(act: Callable[[Tensor], Tensor], form: str, dtype: torch.dtype, c: Tensor, u: Tensor,
                       grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _elementwise_backward(act, form, _expand_restored(c, dtype), u, grad_h)


def _elementwise_backward_eager(act: Callable[[Tensor], Tensor], form: str, g: Tensor, u: Tensor,
                                grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # grad_g = grad_h * u * act'(g) (fp32), grad_u = grad_h * act(g), h = act(g) * u: [..., I] each
    a = act(g)
    grad_g = (grad_h.float() * u.float() * derivative(form, g.float())).to(g.dtype)
    return grad_g, grad_h * a, a * u


def _elementwise_backward(act: Callable[[Tensor], Tensor], form: str, g: Tensor, u: Tensor,
                          grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_g, grad_u, h)``: one compiled loop where the tensors are large and alike (:func:`slimact.quant.
    inductor.fused`; about 12 eager passes otherwise), else eagerly with the model's own activation. The loop
    computes the activation by its form's formula (one compiled loop per form, not per model's module), which
    may round differently from the module's own code: ``h`` and ``grad_u`` to float rounding."""
    if inductor.pays_off(g) and all(t.shape == g.shape and t.is_contiguous() for t in (g, u, grad_h)):
        key = ("gated-mlp", form, g.dtype, u.dtype, grad_h.dtype)
        result = inductor.fused(_elementwise_backward_eager, key, _FORMULAS[form], form, g, u, grad_h)
        if result is not None:
            return result
    return _elementwise_backward_eager(act, form, g, u, grad_h)


#: The activation of each form by its formula, one callable per form (what the compiled loops trace).
_FORMULAS = {form: functools.partial(reference, form) for form in ("gelu", "gelu_tanh", "quick_gelu", "silu")}

#: ``(g, u, grad_h) -> (grad_g, grad_u, h)`` of each form by its formula, for the loop that restores g and u
#: (:func:`slimact.quant.unpack_map`: one compiled loop per callable).
_RESTORED_BACKWARDS = {
    form: functools.partial(_elementwise_backward_eager, formula, form) for form, formula in _FORMULAS.items()
}
#: The same from ``c`` (g's companded codes) and u, by form and g's dtype (those a pack compresses).
_COMPANDED_BACKWARDS = {
    (form, dtype): functools.partial(_expanded_backward_eager, formula, form, dtype)
    for form, formula in _FORMULAS.items() for dtype in (torch.float32, torch.float16, torch.bfloat16)
}


def gated_mlp(
    g: Tensor,
    u: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    form: str,
    cfg: QuantConfig | None,
    act: Callable[[Tensor], Tensor] | None = None,
    state_g: RunningRange | None = None,
    state_u: RunningRange | None = None,
) -> Tensor:
    """``F.linear(act(g) * u, weight, bias)`` keeping only ``g`` and ``u``.

    Args:
        g, u: ``[..., I]`` gate and up projections; ``weight``: ``[H, I]`` (the down projection), ``bias``.
        form: the activation's form (``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"quick_gelu"``).
        cfg: compression of ``g`` and ``u``; ``None`` keeps them exact.
        act: the activation as the model computes it (default: the form's reference).
        state_g, state_u: running estimates of ``g`` and ``u``, for ``scale="running"``.
    """
    if act is None:

        def act(t: Tensor) -> Tensor:
            return reference(form, t)

    if not torch.is_grad_enabled() or not (g.requires_grad or u.requires_grad or weight.requires_grad):
        return F.linear(act(g) * u, weight, bias)
    read_in_root(act, g)
    return _GatedMLPFunction.apply(g, u, weight, bias, act, form, cfg, state_g, state_u)
