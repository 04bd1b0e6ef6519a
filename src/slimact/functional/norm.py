"""LayerNorm, RMSNorm and GroupNorm keeping their output, the tensor the next layer keeps anyway (one shared copy).

Math, per row over the last dim (``M`` channels); ``centered`` (LayerNorm) subtracts the mean, RMSNorm not::

    xn     = (x - mean) * rstd        or   x * rstd,   rstd = 1 / sqrt(var + eps)  or  1 / sqrt(mean(x^2) + eps)
    y      = xn * w + b                    (Gemma's RMSNorm: w = 1 + weight; no b)
    grad_x = rstd * (gw - mean(gw) - xn * mean(gw * xn))     [RMSNorm: without the mean(gw) term]
    grad_w = sum_rows(grad_y * xn),   grad_b = sum_rows(grad_y),   gw = grad_y * w

The backward needs only ``xn`` and ``rstd``, and ``xn = (y - b) / w`` comes back from the output (Tempo's
in-place LayerNorm). So the layer keeps ``y`` and the per-row ``rstd`` (4 bytes per row): exactly under a
lossless policy, where ``y`` is the very tensor the next Linear keeps, or packed with one scale per channel
under an 8-bit one, a pack the next slimact layer then reuses. Per-channel scales make the error in ``xn``
independent of ``w``: ``y_c``'s step is ``|w_c| * range(xn_c) / 255``.

Guard (Tempo had none): ``xn`` cannot come back where ``w_c == 0``, and where ``|b_c| >> |w_c|`` the
output's own float rounding (``eps * |b_c| / |w_c|``) swamps it; for a lossless backward, so does the fp32
rounding of ``x * rstd`` on a LayerNorm row whose mean is far beyond its spread (``eps32 * |mean| * rstd``: a
constant row). A layer any of whose channels (or, lossless, rows) fails (exact: ``|b_c| <= 16 |w_c|``,
``eps32 |mean| rstd <= 16 eps``; 8-bit: ``eps * |b_c| * 512 <= |w_c|``) keeps what it normalised instead: under a
lossless policy its input itself (the tensor the layer before keeps) and the exact ``mean``/``rstd``; under an
8-bit policy ``xn`` at 8 bits (1 byte per element, every row at unit spread) and ``rstd``. (Mesa keeps the input's
codes: their channel groups share a scale over rows of any spread, and ``xn = (x - mean) * rstd`` rebuilt from
them is off by ``step * rstd``, which swamps a row of small spread: 25% constant rows, as padding gives, put a
bf16 LayerNorm's weight gradient at cosine 0.60.) The gradients are computed from ``xn`` by the same formula. The
forward is the replaced module's own code either way: identical output.

A LayerNorm ignores a shift of its input row, so its exact ``grad_x`` sums to zero over the row: a per-row
constant added before it (MLP-Mixer's token-mixing output bias, added to every channel of its token, feeds only
LayerNorms) has a gradient of exactly zero. The formula gives that only where ``sum(xn) = 0``; an ``xn`` restored
from 8-bit codes (output or input) misses it by a fraction of a step per element, and that leaked such a bias a
gradient of 1e-3 of a typical one (``slimact.check`` failing on MLP-Mixer under ``"int8"`` and ``"mesa"``). The
backward therefore re-centres the restored ``xn`` (a projection: it only removes error, the exact ``xn`` having
zero mean), which brings that gradient back to float noise (1e-7). An ``xn`` from the tensor itself (lossless) has
that mean already, to float rounding, and is left as it is (the pass cost 12-19% of a lossless backward).

A norm ignores a scale of its input row too, so its exact ``grad_x`` is orthogonal to ``xn``: the part of ``gw``
along ``xn`` cancels. Where that part dominates, ``grad_x`` is the small remainder of the cancellation
(BlenderbotSmall's final LayerNorm, fed back through tied embeddings: ``gw`` at cosine -0.96 with ``xn``, ``grad_x``
a third of ``gw``). The formula gives ``sum(grad_x * xn) = rstd * M * mean(gw * xn) * (1 - mean(xn^2))``, the exact
``eps * rstd^2`` in place of ``1 - mean(xn^2)`` only where ``xn`` has the exact mean square ``var * rstd^2 = 1 - eps
* rstd^2``; a restored ``xn`` whose length is off by ``d`` leaked ``mean(gw * xn) * d`` along ``xn``, first order in
the 8-bit error and systematic where values saturate (a running estimate clips a batch's extremes, which shortens
the row), onto whatever scales the row: the weight of the norm before it in a post-LN stack (BlenderbotSmall under
``"mesa"`` at 2 rows: that weight's gradient at cosine 0.29; the error in the pooler LayerNorm's ``grad_x`` of BEiT,
whose mean-pooled input is itself a small remainder, lay along ``xn``: 0.287 of 0.294 in norm, its ``cls_token`` at
cosine 0.78). The backward therefore also scales the restored ``xn`` per row to that exact mean square (from the
exact ``rstd`` and ``eps``: a projection onto the sphere the exact ``xn`` lies on, which only removes error), after
the re-centring; ``grad_x`` is then orthogonal to it, and what is left along the exact ``xn`` is second order. The
restored ``xn``'s direction error times the cancelled part stays first order (``|gw| * step`` against a remainder:
an amplification no projection removes; see also the next paragraph): under ``"int8"`` that is small (its own range,
no clipping), under ``"mesa"`` it is the saturation's (Mesa's scheme at few rows per channel). Measured
(``tests/functional/test_norm.py::test_a_scale_of_the_row_gets_no_gradient_from_the_restored_xns_length``, 8 x 16
rows of 64, upstream gradient mostly along ``xn``): the error along ``xn`` 3-6x smaller, the row scale's gradient
27.1 -> 35.2 dB (LayerNorm), 27.7 -> 35.1 dB (RMSNorm) under ``"mesa"``, 56-61 dB under ``"int8"`` either way;
BlenderbotSmall under ``"mesa"``, fresh batches of 2 / 8 / 32 rows: min cosine 0.29 / 0.68 / 0.978 -> 0.59 / 0.83 /
0.989 (the rest is the saturation); tiny Llama, GPT-2, BERT, ViT unchanged or better (Llama at 2 rows 0.957 ->
0.961, int8 0.9999 as before). Rows whose variance is far below ``eps`` (under ``eps / 1024``: BLIP's
post-LayerNorm applied again to pooled, already normalized rows) are left as restored: fp32's ``rstd`` cannot give
their ``1 - eps * rstd^2`` (it rounded to 0 there, and the zeroed ``xn`` zeroed the weight's gradient). Only an
``xn`` restored from codes that can saturate is rescaled (a running estimate or a clip, which shorten the row
along itself): rounding's error with each tensor's own range is unbiased and independent of ``xn``, it lengthens
the row in quadrature, and scaling that away shrinks the true part with it (a 4-bit dynamic policy, the test
above: 34.9 -> 32.4 dB; ``"int8"`` 60.4 dB either way). The rescale costs one more row sum, in the pass that takes
the formula's: +11% on the compiled 8-bit LayerNorm backward, [4, 512, 768] fp32 on the CPU, which ``"int8"`` does
not pay. An exact ``xn`` has its length already.

A row of two elements is kept exact: a LayerNorm over two features maps each row to ``+-sqrt(1 - eps * rstd^2)``,
so its exact ``grad_x`` is eps's share of the upstream gradient alone, which any 8-bit error in ``xn`` swamps
(pytorch-forecasting's TFT selects between two variables through ``nn.LayerNorm(2)``: the weight gradient before it
at cosine 0.85 and 1.45x plain's at 4 rows under ``"int8"``, sign-flipped at 141-245x after 3 steps; a review,
2026-12-07). Three features or more keep cosine >= 0.9999 there.

A learned mix of streams (found in the autograd graph, not by class): where the norm's input is
``h = sum_k a_k * x_k`` with mixing weights ``a_k`` that require a gradient (DeepSeek-V4's hyper-connection
heads: ``(pre.unsqueeze(-1) * streams).sum(dim)``), the weights' gradient is ``grad_h . x_k``. The exact
``grad_h`` is orthogonal to ``xn`` (RMSNorm; LayerNorm: to ``xn`` and to constants), and streams that start as
copies of one hidden state stay nearly parallel to ``h``, so ``grad_h . x_k`` is the small remainder of a
cancellation. An 8-bit ``xn`` leaves ``grad_h`` an error of about ``|grad_h| * step`` along ``h``, which swamps
that remainder (measured: DeepSeek-V4's ``hc_head.hc_fn`` gradient at cosine 0.88 with the output kept 8-bit,
1.0 with the norm's input exact). Restoring orthogonality to the restored ``xn`` does not help: the error is
the restored ``xn``'s own direction error, ``grad_h . (xn - xn_hat)``, the same order. Such a norm keeps its
tensors exact under every policy (:func:`_learned_mix`, read from the autograd graph before the Function runs).
Under ``torch.compile`` the traced graph has no autograd history to read: there the check is not made and the
norm keeps its 8-bit tensor (a graph break per norm otherwise; a model of this form should be checked eagerly with
``slimact.check``).

GroupNorm (``groups = G >= 1``) is the same normalisation over other rows: ``x [N, C, *]`` seen as
``[N, G, C/G, S]`` (``S = prod(*)``), one row per ``(n, g)`` of ``C/G * S`` elements, the affine per channel ``c``
(dim 1)::

    xn     = (x - mean_ng) * rstd_ng,   y = xn * w_c + b_c
    grad_x = rstd_ng * (gw - mean_ng(gw) - xn * mean_ng(gw * xn)),   gw = grad_y * w_c
    grad_w = sum_{n, *}(grad_y * xn),   grad_b = sum_{n, *}(grad_y)

so the backward needs what LayerNorm's needs, ``xn`` (from ``y``, ``w_c``, ``b_c``) and the per-row ``rstd``
(``[N, G]``), and the same guard holds channel by channel (a GroupNorm ignores a shift and a scale of its row too: the
restored ``xn`` is re-centred and rescaled per row, as above). The 8-bit pack of ``y`` has one scale per channel along
dim 1 (the step of ``y_c`` is ``|w_c| * range(xn_c) / 255``, as above), which the next layer's pack reuses (the
SiLU and the conv of a diffusion UNet's ``GroupNorm -> SiLU -> Conv``). The forward is ``native_group_norm``, which
``F.group_norm`` runs on the same contiguous input (its output bit for bit, its statistics with it), under
autocast ``F.group_norm`` itself (whose casts the native op would not see) with the statistics taken afresh.
GroupNorm's bytes: plain keeps ``x`` (4 per element, fp32) + mean and rstd (8 per ``(n, g)``); slimact ``y``, 1 per
element (+ 8 per channel) at 8 bits, 4 exact (0 extra where the next layer keeps ``y``: GroupNorm -> Conv), + rstd
(4 per ``(n, g)``). A lossless SiLU after it keeps its own output (the conv's input) and a bit mask, not ``y``, so
``GroupNorm -> SiLU -> Conv`` keeps two full tensors under a lossless policy whether the norm keeps ``x`` or ``y``,
and more where a shortcut conv keeps ``x`` too: the ``"tempo"`` preset leaves GroupNorm alone
(:data:`slimact.policy.PRESETS`). Under a lossless policy a GroupNorm whose parameters are of a finer dtype than
its output keeps its input (:func:`_params_wider`); on the CPU its backward sums its long rows in fp64
(:func:`_accumulator`). Error at 8 bits: ``xn`` within half a step, ``range(xn_c) / 510``, whatever
``w_c``; measured gradient SQNR 57-64 dB (input), 44-53 dB (weight) in fp32, the bias gradient exact.

Bytes kept, fp32 model: plain PyTorch keeps ``x`` (4 per element) + mean and rstd (8 per row); slimact
keeps 0 extra per element under a lossless policy (``y`` is kept by the next layer anyway) or 1 per element
(+ 8 per channel) at 8 bits, + 4 per row. Tests: gradients equal PyTorch's to float rounding (lossless),
SQNR >= 30 dB (8-bit), for GroupNorm too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor
from torch._prims_common import suggest_memory_format

from slimact._cache import cache
from slimact.functional._saving import SlimFunction, foreign_saved_hooks, keep_output, load, save
from slimact.quant import QuantConfig, RunningRange, inductor, pack
from slimact.quant.reference import COMPRESSIBLE_DTYPES
from slimact.quant.state import few_rows

__all__ = ["group_norm", "norm", "output_kept_as", "output_recoverable", "rms_default_eps"]


def rms_default_eps(dtype: torch.dtype) -> float:
    """The ``eps`` PyTorch's RMSNorm kernel adds when given none: that of the dtype it computes in (fp32 for
    half-precision inputs, not the input's own: bf16's 2^-7 would dwarf the mean square of a small row)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def output_recoverable(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype, exact: bool) -> bool:
    """Whether ``xn = (y - b) / w`` is well conditioned for every channel (one host sync)."""
    ok = _channels_recoverable(weight, bias, dtype, exact)
    return ok is None or bool(ok.all())


def _channels_recoverable(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype, exact: bool) -> Tensor | None:
    """Per channel, :func:`output_recoverable` (``None``: no weight, always)."""
    if weight is None:
        return None
    w = weight.detach().float().abs()
    b = bias.detach().float().abs() if bias is not None else torch.zeros_like(w)
    if exact:
        return (w >= torch.finfo(dtype).tiny * 1024) & (b <= 16 * w)
    return (w > 0) & (torch.finfo(dtype).eps * b * 512 <= w)


def _rows_recoverable(mean: Tensor, rstd: Tensor, dtype: torch.dtype) -> Tensor:
    """Per row, whether ``xn`` survives the rounding of the output exactly enough for a lossless backward: the
    forward computes ``y`` in fp32 from ``x`` (PyTorch's kernel: ``x * (rstd w) + (b - mean rstd w)``), so
    ``xn = (y - b) / w`` carries an error of ``eps32 * |mean| * rstd``, which swamps ``xn`` on a row whose mean is
    far beyond its spread (a constant row, ``rstd = 1/sqrt(eps)``: a weight gradient off by O(1) in bf16). The
    limit is the channels': 16 roundings of ``y``'s dtype. (An 8-bit layer has no better choice: the input it
    would keep instead is restored within ``|mean| * rstd / 255`` of such a row's xn.)"""
    eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    return (mean.abs() * rstd * eps <= 16 * torch.finfo(dtype).eps).reshape(-1)


def output_kept_as(t: Tensor) -> tuple[str, str] | None:
    """``(kind, kept)`` where ``t`` is the output of slimact's norm Function, unchanged since (its ``grad_fn`` is that
    Function's node, which an in-place change or a view would replace): ``kind`` ``"layernorm"``, ``"rmsnorm"`` or
    ``"groupnorm"``; ``kept`` ``"codes"`` where the norm keeps ``t`` packed (a later ``pack(t)`` reuses that pack: no
    bytes of its own), ``"input"`` where it keeps its input instead (the guard), ``"exact"`` where it keeps ``t``
    itself (a lossless policy, a learned mix, NaN/inf). Else ``None``."""
    node = t.grad_fn
    if type(node) is not _NormFunction._backward_cls:
        return None
    kind = "groupnorm" if node.groups else "layernorm" if node.centered else "rmsnorm"
    return kind, "codes" if node.output_codes else "exact" if node.from_output else "input"


def _learned_mix(x: Tensor) -> bool:
    """Whether ``x`` is a sum over a dim of a product with a factor that requires a gradient (a learned mix of
    streams: ``(weights.unsqueeze(-1) * streams).sum(dim)``), looking through dtype casts and views. Which
    factor is the weights the graph does not say; a product of a learned tensor with a constant one (a masked
    pooling) is taken for a mix too: its norm keeps plain PyTorch's bytes, never a wrong gradient."""
    node = x.grad_fn
    while node is not None and type(node).__name__.startswith(("ToCopyBackward", "ViewBackward", "CloneBackward")):
        node = node.next_functions[0][0]
    if node is None or not type(node).__name__.startswith("SumBackward"):
        return False
    inner = node.next_functions[0][0]
    # (slimact's broadcast product too, which the routing sends a norm's output times a broadcast factor)
    if inner is None or not type(inner).__name__.startswith(("MulBackward", "_BroadcastProductFunctionBackward")):
        return False
    return any(fn is not None for fn, _ in inner.next_functions)


def _rows(t: Tensor, groups: int) -> Tensor:
    """``t`` as the rows the norm normalises: ``[..., C]`` itself (``groups`` 0: over the last dim), or
    ``[N, C, *]`` as ``[N, G, C/G, S]`` (GroupNorm: a row per ``(n, g)``, over the last two dims)."""
    return t if not groups else t.reshape(t.shape[0], groups, t.shape[1] // groups, -1)


def _row_dims(groups: int) -> tuple[int, ...]:
    """The dims of :func:`_rows`' view that one row spans."""
    return (-2, -1) if groups else (-1,)


def _per_channel(p: Tensor | None, groups: int) -> Tensor | None:
    """A ``[C]`` parameter shaped to broadcast over :func:`_rows`' view: ``[C]``, or ``[G, C/G, 1]``."""
    return p if p is None or not groups else p.reshape(groups, -1, 1)


def _channel_sums(t: Tensor, groups: int) -> Tensor:
    """Per channel, the sum of :func:`_rows`' view ``t`` over everything else: ``[C]`` (GroupNorm's in
    :func:`_accumulator`'s dtype)."""
    if groups:
        return t.sum((0, 3), dtype=_accumulator(t, groups)).reshape(-1)  # [G, C/G] -> [C]
    return t.reshape(-1, t.shape[-1]).sum(0)


def _accumulator(t: Tensor, groups: int) -> torch.dtype | None:
    """The dtype GroupNorm's backward on the CPU sums its rows and channels in: fp64 (elsewhere, and LayerNorm's
    and RMSNorm's: ``None``, fp32). A GroupNorm's row is long (``C/G * S`` elements: 32 Ki in ``[8, 64, 32, 32]``
    with 2 groups, a million at 512 x 512), as is a channel's sum (``N * S``), and the compiled CPU loop adds them
    in order, its roundings all of one sign where the values repeat (an upstream gradient constant per channel: a
    sum, a global pooling after the norm): there the input gradient was 2.4e-5 off the exact one (PyTorch's
    2.0e-7), the bias gradient 3.7e-5 (1.1e-6). Summed in fp64 both are within 2e-7, no slower measured
    (``[2, 128, 128, 128]``: 32-37 ms per backward against 46-50). CUDA's reductions (eager; Triton's: per lane,
    then a tree) add far fewer terms in sequence (not measured here)."""
    return torch.float64 if groups and t.device.type == "cpu" else None


def _row_stats(x: Tensor, centered: bool, eps: float, groups: int = 0) -> tuple[Tensor | None, Tensor]:
    """Per-row fp32 ``(mean, rstd)``, shaped ``[..., 1]`` (or ``[N, G, 1, 1]``: :func:`_rows`) (``mean`` None if not
    centered)."""
    xf, dims = _rows(x.float(), groups), _row_dims(groups)
    if centered:
        var, mean = torch.var_mean(xf, dims, unbiased=False, keepdim=True)
        return mean, torch.rsqrt(var + eps)
    return None, torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)


def _output_kept(weight: Tensor | None, bias: Tensor | None, offset: float, mean: Tensor | None, rstd: Tensor,
                 dtype: torch.dtype, exact: bool) -> bool:
    """Whether the layer keeps its output: every channel recoverable (:func:`output_recoverable` of ``(weight +
    offset, bias)``) and, for a lossless LayerNorm, every row (:func:`_rows_recoverable`); one host read for both
    (one sync on a GPU), at every call. Not cached by the weight's version counter: an update through ``.data``
    (a hand-written SGD step, pruning ``norm.weight.data[c] = 0``) and the fused optimizers that write parameters
    in their own kernels (apex, DeepSpeed, bitsandbytes) leave the counter as it was, and a stale answer rebuilt
    ``xn`` from a zeroed channel: NaN gradients where the plain layer's are finite."""
    flags = []
    if weight is not None:
        flags.append(_channels_recoverable(_effective(weight, offset), bias, dtype, exact).all())
    if mean is not None and exact:
        flags.append(_rows_recoverable(mean, rstd, dtype).all())
    if not flags:
        return True
    return bool(flags[0]) if len(flags) == 1 else all(torch.stack(flags).tolist())


def _params_wider(weight: Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the weight is of a finer float type than the output ``dtype`` (fp32 parameters, bf16 or fp16
    activations: guided diffusion's GroupNorm32 in a half-precision model). PyTorch's GroupNorm weight gradient,
    from the exact input, is then accurate to the weight's dtype; one from ``xn`` restored out of the rounded output
    only to the output's (lossless, bf16: 1.8e-3 off the exact one, PyTorch's 6e-8; ``slimact.check`` failing it):
    a lossless GroupNorm keeps its input there. (PyTorch's mixed-type LayerNorm computes its parameters' gradients
    no better than the output's rounding: 1.3e-2 off in bf16, slimact's 2.1e-3; it keeps its output as before.)"""
    return weight is not None and torch.finfo(weight.dtype).eps < torch.finfo(dtype).eps


def _effective(weight: Tensor | None, offset: float) -> Tensor | None:
    """The scale a norm multiplies by: ``weight + offset`` (Gemma's ``1 + w``), the weight itself for offset 0."""
    return weight + offset if weight is not None and offset else weight


def _layer_norm_with_stats(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                           eps: float) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``F.layer_norm(x, [C], weight, bias, eps)`` with the kernel's own per-row fp32 ``(mean, rstd)``
    (``[..., 1]``): ``torch.native_layer_norm``, which ``F.layer_norm`` runs and whose output it returns (the
    same output bit for bit), so that no second pass over ``x`` computes them. The statistics are ``None``
    where they are not fp32 (half-precision inputs on the CPU), to be computed in fp32 from ``x`` instead."""
    y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
    if mean.dtype == torch.float32 and rstd.dtype == torch.float32:
        return y, mean, rstd
    return y, None, None


def _group_norm_with_stats(x: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None,
                           eps: float) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``F.group_norm(x, groups, weight, bias, eps)`` with the kernel's per-row fp32 ``(mean, rstd)`` (``[N, G, 1,
    1]``): ``torch.native_group_norm`` on the input ``F.group_norm`` hands it (contiguous in its suggested memory
    format on the CPU, contiguous elsewhere; ATen's ``group_norm``), whose output it returns. Under autocast
    ``F.group_norm`` itself (autocast may cast its inputs, not the native op's); the statistics are then ``None``,
    as where they are not fp32 (half-precision inputs), to be computed in fp32 from ``x``."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.nn.functional.group_norm(x, groups, weight, bias, eps), None, None
    n, c = x.shape[0], x.shape[1]
    on_cpu = x.device.type in ("cpu", "xpu")
    inner = x.contiguous(memory_format=suggest_memory_format(x)) if on_cpu else x.contiguous()  # (ATen's choice)
    y, mean, rstd = torch.native_group_norm(
        inner, None if weight is None else weight.contiguous(), None if bias is None else bias.contiguous(),
        n, c, x.numel() // max(n * c, 1), groups, eps)
    if mean.dtype == torch.float32 and rstd.dtype == torch.float32:
        return y, mean.view(n, groups, 1, 1), rstd.view(n, groups, 1, 1)
    return y, None, None


def _default_fn(channels: int, w_eff: Tensor | None, bias: Tensor | None, eps: float,
                centered: bool, groups: int = 0) -> Callable[[Tensor], Tensor]:
    """``F.layer_norm`` (centered) or ``F.rms_norm`` over the last dim, or ``F.group_norm`` (``groups``), as a
    function of the input."""
    if groups:
        return lambda t: torch.nn.functional.group_norm(t, groups, w_eff, bias, eps)
    if centered:
        return lambda t: torch.nn.functional.layer_norm(t, [channels], w_eff, bias, eps)
    return lambda t: torch.nn.functional.rms_norm(t, [channels], w_eff, eps)


class _NormFunction(SlimFunction):
    layer = "LayerNorm/RMSNorm/GroupNorm"

    @staticmethod
    def forward(ctx, x, weight, bias, fn, centered, eps, offset, groups, cfg, state):
        # fn None: F.layer_norm (centered) or F.group_norm (groups) itself, taken with its kernel's statistics
        if fn is None and groups:
            y, mean, rstd = _group_norm_with_stats(x, groups, weight, bias, eps)
        elif fn is None:
            y, mean, rstd = _layer_norm_with_stats(x, _effective(weight, offset), bias, eps)
        else:
            y, mean, rstd = fn(x), None, None
        if rstd is None:
            mean, rstd = _row_stats(x, centered, eps, groups)
        ctx.centered, ctx.offset, ctx.groups, ctx.eps = centered, offset, groups, float(eps)
        exact = cfg is None
        if torch.compiler.is_compiling():
            # Under torch.compile (where a host read would break the graph) the input is kept whenever the
            # choice depends on the data, and whenever the output would be kept as it is (exact, or a dtype no
            # pack compresses): the traced graph functionalises an in-place op on the output in model code
            # (`h += x`) and hands the backward the output after it, with no version check (a weightless RMSNorm's
            # input gradient 0.9 off, silently), and copy_on_write does not run there.
            ctx.from_output = weight is None and not exact and x.dtype in COMPRESSIBLE_DTYPES
        else:
            ctx.from_output = (_output_kept(weight, bias, offset, mean, rstd, x.dtype, exact)
                               and not (exact and groups and _params_wider(weight, y.dtype))
                               and not (exact and foreign_saved_hooks()))
        if ctx.from_output:
            # one scale per channel: the last dim's, or GroupNorm's dim 1
            per_channel = None if cfg is None else dataclasses.replace(cfg, group_dim=1 if groups else -1, groups=0)
            kept = pack(y, per_channel, state)
            save(ctx, kept, None, rstd, weight, bias)
            if kept.meta.raw:
                keep_output(y, ctx)
        elif exact:
            kept = pack(x, cfg, _input_state(state))  # (x itself: what the layer before keeps too)
            save(ctx, kept, mean, rstd, weight, bias)
        else:
            # The normalised input xn, each row at unit spread, at 8 bits: x's codes share a channel group's scale
            # over rows of any spread, and xn rebuilt from them was off by step * rstd, a row of small spread's
            # swamped (a LayerNorm with 25% constant rows: weight gradient at cosine 0.60, input gradient 0.33).
            rows = _rows(x.float(), groups)
            xn = ((rows - mean) * rstd if centered else rows * rstd).reshape(x.shape).to(x.dtype)
            kept = pack(xn, cfg, _input_state(state))
            save(ctx, kept, None, rstd, weight, bias)
        ctx.normalized = not ctx.from_output and not exact
        # xn restored from codes is re-centred in the backward (module docstring); one from the tensor itself is
        # exact to float rounding, centred as plain's
        ctx.recentre = centered and not kept.meta.raw
        # and, where it can saturate, brought back to the exact xn's mean square (module docstring), so that the
        # layer ignores a scale of its row as the exact one does
        ctx.rescale = not kept.meta.raw and _length_may_drift(cfg)
        # Whether the output is kept as codes (a pack a broadcast product of the output then reuses:
        # :func:`output_kept_as`)
        ctx.output_codes = ctx.from_output and not kept.meta.raw
        return y

    @staticmethod
    def backward(ctx, grad_y):
        kept, mean, rstd, weight, bias = load(ctx)
        need = ctx.needs_input_grad  # x, weight, bias, ...
        groups = ctx.groups
        args = (kept, mean, rstd, weight, bias, grad_y, ctx.centered, ctx.offset, ctx.from_output, groups, ctx.recentre,
                ctx.normalized)
        key = ("norm", ctx.centered, ctx.offset, ctx.from_output, mean is None, weight is None, bias is None,
               kept.dtype, grad_y.dtype, groups > 0, ctx.recentre, ctx.normalized, ctx.eps if ctx.rescale else None)
        fn = _rescaled_backward(ctx.eps) if ctx.rescale else _backward
        grad_x, grad_w, grad_b = inductor.fused_or_eager(fn, key, *args)
        return (grad_x if need[0] else None, grad_w if weight is not None and need[1] else None,
                grad_b if bias is not None and need[2] else None, None, None, None, None, None, None, None)


def _input_state(state: RunningRange | None) -> RunningRange | None:
    """The running estimate of the input a layer keeps in place of its output (the guard), in estimates of its own:
    ``state`` estimates the output's per-channel ranges, and the input's pack (``cfg``'s channel groups) has as many
    groups where ``C`` is their count (a norm of 8 channels under ``"mesa"``), where one shared estimate clipped the
    input to the output's range the step a channel's weight reached 0 (weight gradient cosine 0.06)."""
    if state is None or torch.compiler.is_compiling():
        # (traced packs use no running estimate: quant.core._pack_traced; a RunningRange made while dynamo traces
        # an autograd Function's forward broke the trace of its backward: an internal error on Llama under mesa)
        return state
    return RunningRange(state.module, state.lo_name.removesuffix("_lo") + "_input")


def _length_may_drift(cfg: QuantConfig) -> bool:
    """Whether a row restored from ``cfg``'s codes can come back shortened along itself, which the backward's rescale
    corrects (module docstring): values saturate under a running estimate or a clip. Rounding's error is unbiased
    and independent of ``xn`` (each tensor's own range, outliers kept apart): it lengthens the row in quadrature,
    and scaling that away shrinks the true part with it (a 4-bit dynamic policy: the row scale's gradient 34.9 ->
    32.4 dB with the rescale; ``"int8"`` 60.4 dB either way), so such packs are not rescaled (nor pay the 11% of
    the compiled LayerNorm backward)."""
    return cfg.scale == "running" or cfg.clip is not None


#: The inverse of ``2**-10``, the smallest exact mean square of ``xn``, ``1 - eps * rstd^2``, the backward rescales a
#: restored ``xn`` to: fp32's ``rstd`` (rounded, and an approximate reciprocal square root on GPUs: a few 2^-24
#: relative) gives that difference to about 2^-22 absolute, so to 2^-12 relative here; below it (rows of variance
#: under ``eps / 1024``) it is noise. An integer (``target * 2**10 >= 1`` is exactly ``target >= 2**-10``): a
#: module-level float is an input of the graph under torch.compile(dynamic=True), which fails to trace where two
#: autograd.Functions read it.
_RESCALE_FLOOR_INVERSE = 2**10


@cache(maxsize=64)
def _rescaled_backward(eps: float) -> Callable[..., tuple[Tensor, Tensor | None, Tensor | None]]:
    """:func:`_backward` with ``rescale_eps=eps``, a constant of the function (one compiled copy per ``eps``: passed as
    an argument, the float made the compiled backward 2.4x slower, [4, 512, 768] fp32 on the CPU)."""

    def backward(*args):
        return _backward(*args, rescale_eps=eps)

    return backward


def _backward(kept: Tensor, mean: Tensor | None, rstd: Tensor, weight: Tensor | None, bias: Tensor | None,
              grad_y: Tensor, centered: bool, offset: float, from_output: bool, groups: int = 0,
              recentre: bool = False, normalized: bool = False, rescale_eps: float | None = None):
    """``(grad_x, grad_w, grad_b)`` from what the forward kept (the module docstring's formulas, in fp32, over the
    rows of :func:`_rows`); one compiled loop per row pass where the tensor is large
    (:func:`slimact.quant.inductor.fused`: about 12 eager passes otherwise). ``recentre``: ``kept`` was restored
    from codes, and ``xn`` is re-centred per row (the module docstring; an exact ``kept`` has no need of the pass,
    12-19% of a lossless backward's time). ``rescale_eps``: the layer's ``eps``, where ``kept`` was restored from
    codes: ``xn`` is then scaled per row to the exact one's mean square, ``1 - eps * rstd^2`` (module docstring)."""
    g = _rows(grad_y.float(), groups)  # [..., C] or [N, G, C/G, S]
    kept = _rows(kept.float(), groups)
    dims = _row_dims(groups)
    w = None if weight is None else _per_channel(weight.float() + offset, groups)  # [C] or [G, C/G, 1]
    if from_output:
        xn = kept if bias is None else kept - _per_channel(bias.float(), groups)
        if w is not None:
            xn = xn / w
    elif normalized:  # (the forward kept xn itself)
        xn = kept
    else:
        xn = (kept - mean) * rstd if centered else kept * rstd
    acc = _accumulator(g, groups)
    if recentre:  # an exact xn has zero mean per row; one restored from 8-bit codes not (module docstring)
        xn = xn - xn.mean(dims, keepdim=True, dtype=acc).float()
    gw = g if w is None else g * w
    dot = (gw * xn).mean(dims, keepdim=True, dtype=acc).float()
    if rescale_eps is not None:
        # An exact xn has the mean square var * rstd^2 = 1 - eps * rstd^2 per row; one restored from 8-bit codes not
        # (module docstring): xn * factor has it, its sum taken in the pass that takes the formula's row sums.
        # Where var << eps the target is a cancellation that fp32's rstd cannot resolve (BLIP's post-LayerNorm on
        # pooled rows of var 1e-15, eps 1e-5: 1 - eps * rstd^2 rounds to 0, and a zero xn zeroed its weight's
        # gradient): the restored xn is kept as it is there.
        square = (xn * xn).mean(dims, keepdim=True, dtype=acc).float()
        target = 1 - rescale_eps * rstd * rstd
        factor = torch.where((square > 0) & (target * _RESCALE_FLOOR_INVERSE >= 1), (target / square).sqrt(), 1.0)
        xn, dot = xn * factor, dot * factor
    inner = gw - xn * dot
    if centered:
        inner = inner - gw.mean(dims, keepdim=True, dtype=acc).float()
    grad_x = (rstd * inner).reshape(grad_y.shape).to(grad_y.dtype)
    grad_w = None if weight is None else _channel_sums(g * xn, groups).to(weight.dtype)
    grad_b = None if bias is None else _channel_sums(g, groups).to(bias.dtype)
    return grad_x, grad_w, grad_b


def norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    cfg: QuantConfig | None,
    state: RunningRange | None = None,
    *,
    centered: bool = True,
    offset: float = 0.0,
    fn: Callable[[Tensor], Tensor] | None = None,
    groups: int = 0,
) -> Tensor:
    """LayerNorm (``centered``) or RMSNorm over the last dim, or GroupNorm (``groups``), keeping its output for the
    backward.

    Args:
        x: ``[..., C]``; ``[N, C, *]`` for GroupNorm.
        weight, bias: ``[C]`` or ``None``; the effective scale is ``weight + offset`` (Gemma: ``offset=1``).
        eps: added to the variance (or mean square).
        cfg: how kept tensors are compressed; ``None`` keeps them exact.
        fn: the forward to run (a module's own code); default ``F.layer_norm`` (run as ``native_layer_norm``,
            whose statistics the backward keeps: no second pass over ``x``) / ``F.rms_norm`` / ``F.group_norm``
            (run as ``native_group_norm``).
        groups: ``G >= 1``: GroupNorm over dim 1 of ``x`` in ``G`` groups (``centered``, no ``offset``); 0: over the
            last dim.
    """
    if fn is None and not centered:
        fn = _default_fn(x.shape[-1], _effective(weight, offset), bias, eps, False)
    params = [t for t in (weight, bias) if t is not None]
    # An empty batch keeps nothing: its row statistics would be reductions over nothing.
    if not torch.is_grad_enabled() or not (x.requires_grad or any(t.requires_grad for t in params)) or not x.numel():
        if fn is not None:
            return fn(x)
        return _default_fn(x.shape[-1], _effective(weight, offset), bias, eps, centered, groups)(x)
    if cfg is not None and not torch.compiler.is_compiling() and _learned_mix(x):
        cfg = None  # see the module docstring: a learned mix of streams, kept exact
    if cfg is not None and (x[:1].numel() // groups if groups else x.shape[-1]) <= 2:
        cfg = None  # see the module docstring: rows of two elements, kept exact
    if cfg is not None and cfg.scale == "running" and few_rows(x.numel(), x.shape[1 if groups else -1]):
        # Fewer rows per channel than FEW_ROWS (a classifier head's norm after a mean-pool: one row a sample): packed
        # with its own per-channel range, as BatchNorm's input is (slimact.quant.state.few_rows). On a GPU one host
        # sync more, for a tensor of a few rows.
        cfg, state = dataclasses.replace(cfg, scale="dynamic"), None
    return _NormFunction.apply(x, weight, bias, fn, centered, eps, offset, groups, cfg, state)


def _group_norm_applies(x: Tensor, groups: object, weight: object, bias: object) -> bool:
    """Whether ``F.group_norm(x, groups, weight, bias)`` is a GroupNorm :func:`group_norm` computes: ``x`` of
    ``[N, C, *]``, ``C`` a multiple of an integer ``groups``, ``weight`` and ``bias`` ``[C]`` tensors or ``None``, and
    more than one element in a group (a single one, N = 1, G = C, one position, is F.group_norm's "more than 1 value
    per channel" ValueError, where native_group_norm would return the bias)."""
    if x.dim() < 2 or not isinstance(groups, int) or groups < 1 or x.shape[1] % groups or x.numel() == groups:
        return False
    return all(t is None or (isinstance(t, Tensor) and tuple(t.shape) == (x.shape[1],)) for t in (weight, bias))


def group_norm(
    x: Tensor,
    groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    cfg: QuantConfig | None,
    state: RunningRange | None = None,
    *,
    fn: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``F.group_norm(x, groups, weight, bias, eps)`` (or ``fn``, a module's own code computing it) keeping its
    output and per-row ``rstd`` for the backward: :func:`norm` with ``groups`` (see the module docstring).

    Args:
        x: ``[N, C, *]``, ``C`` a multiple of ``groups``.
        weight, bias: ``[C]`` or ``None``.
        cfg: how kept tensors are compressed (one scale per channel, dim 1); ``None`` keeps them exact.
    """
    if not _group_norm_applies(x, groups, weight, bias):  # the call as written (PyTorch's own error)
        return fn(x) if fn is not None else torch.nn.functional.group_norm(x, groups, weight, bias, eps)
    return norm(x, weight, bias, eps, cfg, state, fn=fn, groups=groups)
