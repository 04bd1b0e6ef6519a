"""Attention: fused scaled-dot-product attention keeping no ``[T, S]`` tensor, and eager attention's softmax,
dropout and ``probs @ v`` in one Function (Tempo's attention technique) for when the probabilities are needed.

Fused path (:func:`scaled_dot_product_attention`): never a ``[T, S]`` tensor kept. What is kept, per call, for
``q`` ``[B, H, T, D]`` and ``k``, ``v`` ``[B, H_kv, S, D]`` (grouped-query attention: ``H_kv`` divides ``H``):

* at 8 bits (a per-head config): ``q``, ``k``, ``v`` as 8-bit codes, ``B * (H * T + 2 * H_kv * S) * D`` bytes,
  and their scales: for ``q`` and ``k`` with their own range 8 bytes per 16 channels of a head
  (:mod:`slimact.functional._heads`), else (``v``; running estimates) per head; the backward recomputes the output
  and log-sum-exp from the restored tensors (one more fused forward), so it is the exact gradient of the
  attention of the restored tensors (a kept 8-bit output would disagree with the probabilities rebuilt from
  8-bit ``q`` and ``k`` and blur small ``q``/``k`` gradients). With dropout, also the generator state the
  forward drew from (16 bytes on CUDA).
* under a lossless policy (``cfg=None``, "tempo"): ``q``, ``k``, ``v`` exactly and, for the fused kernels (CUDA's,
  and PyTorch's CPU flash kernel), the output (``B * H * T * D`` elements, the returned tensor itself) and the
  fp32 log-sum-exp (``4 * B * H * T`` bytes; the efficient kernel's rounds ``T`` up to 32); on CUDA also the
  kernel's Philox seed and offset (two scalars).
* a boolean mask as bits (1/8 of its bytes), an additive one of 0 and one fill value (transformers' eager masks) as
  bits too (1/32 of its fp32 bytes), other additive ones as given; once per forward for a mask handed to every
  layer (:func:`_saved_mask`).

Which kernel, where (:func:`fused_kernel` chooses; anything it does not take runs the chunked path):

* CUDA (compute capability 8.0+): PyTorch's fused kernels forward and backward, in the inputs' dtype (no fp32
  upcast, no fp32 scores): ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2) for fp16/bf16
  without a mask (a causal one only square: FlashAttention's ``is_causal`` is bottom-right aligned for
  ``T != S``, PyTorch's top-left), ``aten._scaled_dot_product_efficient_attention`` for fp32, a mask (as an
  additive bias in the query's dtype, its rows in a buffer padded to 16 elements, as the kernel requires), or
  a non-square causal one. Grouped-query attention repeats ``k``, ``v`` to ``H`` heads for the kernels
  (transient, never kept) and sums the gradients back over each group. A fully masked row gets a bias of 0 in
  the kernel and its output and gradient zeroed around it (PyTorch's 0). Taken by the chunked path instead: a
  mask that needs a gradient, head sizes not a multiple of 8 or above 256 (128 off sm80/sm90), other dtypes,
  dropout ``p >= 1``, broadcast batches, and a query or key holding NaN/inf (the kernels' running max drops
  NaN scores; one host sync checks).
* CPU without dropout: PyTorch's CPU flash kernel (``_FlashAttentionCPU``), unless a query or key holds NaN/inf
  (read off the score guard's error at 8 bits, else one fp32 sum of each: :func:`_not_finite`; a finite q, k
  whose sum overflows fp32 takes the chunked path too, exact), or PyTorch's own call runs its math kernel there
  (:func:`_math_chosen`: a mask that needs a gradient, an ``[H, T, S]`` mask): the chunked path's backward, its
  forward that kernel's output.
* Otherwise (CPU with dropout, other devices): ``_ChunkedAttention``, flash-style attention in PyTorch ops, a
  block of query rows at a time, its scores in fp32 (on the CPU its probabilities' product with v too, the output
  rounded once, as PyTorch's math kernel). Its sums run in another order than the math kernel's: with dropout the
  output is within float rounding of PyTorch's, not bit for bit (fp32: 2.4e-7; bf16: a rounding flip of at most one
  bf16 ulp in about 0.03% of the outputs, [4, 2, 32, 32] with p = 0.1). The math kernel itself would be bit for
  bit but takes 3x this path's forward time ([4, 12, 256, 64], causal: 44 ms against 15 ms on 2 CPU cores).

Dropout replay: no mask is drawn, nor kept. The CUDA kernels draw dropout from Philox with a seed and offset
they take from the CUDA generator (and advance it); under a lossless policy the backward gets the seed and
offset the forward kernel returned. At 8 bits the forward snapshots the generator state first (as the chunked
path does for its ``native_dropout`` draw); the backward's recompute runs under ``torch.random.fork_rng`` with
that state restored, so the kernel takes the same seed and offset (hence draws the same mask), and the
generator is left as it was. With the same generator state, the masks are those of
``F.scaled_dot_product_attention`` running the same kernel. A mask that needs a gradient (Swin's and T5's
learned position biases) gets it, the scores' gradient summed over the dims it broadcasts along, from the
chunked path.

Eager path:

Math, with ``s`` the scores ``[B, H, T, S]`` (``q k^T * scale + mask``), ``m`` a Bernoulli(1 - p) mask::

    P = softmax(s),   D = P * m / (1 - p),   o = D v
    grad_v = D^T grad_o,   grad_D = grad_o v^T,   grad_P = grad_D * m / (1 - p),
    grad_s = P * (grad_P - sum(grad_P * P, -1))

Plain PyTorch keeps ``P`` (for the softmax backward), the dropout mask (a bool, or on CPU an fp32 noise
tensor) and ``D`` (for the matmul backward): two full ``[B, H, T, S]`` tensors and a mask. This Function keeps
``P`` once (exact, or 8-bit codes of ``sqrt(P)`` with one scale per head: :mod:`slimact.functional.softmax`),
the mask as bits, and ``v``, and recomputes ``D`` in the backward.
No dropout in eval mode (``p`` is then 0), as PyTorch.

Grouped-query attention: ``v`` is ``[B, H_kv, S, D]`` with ``H = H_kv * n_rep``; the product runs on grouped
views, so the ``n_rep``-times repeated ``v`` is never kept (nor built).

The forward is PyTorch's own ops (``softmax`` in fp32 as Hugging Face computes it, ``native_dropout``, the same
random draws as ``F.dropout``, ``matmul``). Error: exact when ``P`` and ``v`` are kept exact; at 8 bits each
is within its documented error (tests assert SQNR >= 30 dB).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

from slimact._cache import cache, storage_key
from slimact.functional._bernoulli import bernoulli_
from slimact.functional._heads import from_head_blocks, head_blocks
from slimact.functional._saving import Mask, SlimFunction, load, save
from slimact.functional.attention_guard import MAX_SCORE_ERROR, checked_score_error, note_trip
from slimact.functional.dropout import cpu_scale, scale_of
from slimact.functional.softmax import normalized, pack_probabilities
from slimact.quant import Packed, QuantConfig, RunningRange, inductor, pack, pack_many, pack_mask, reference
from slimact.quant.core import forget_shared_packs, kept_whole

__all__ = ["scaled_dot_product_attention", "softmax_dropout_matmul"]


def _pack_qkv(ctx, q: Tensor, k: Tensor, v: Tensor, cfg_q: QuantConfig | None, cfg_kv: QuantConfig | None,
              state: dict[str, RunningRange] | None) -> list[Packed]:
    """``q``, ``k`` and ``v`` packed together: one host sync for the three, not one each (:func:`pack_many`), ``q``
    and ``k`` by blocks of their heads' channels where they are per head (:func:`slimact.functional._heads.head_blocks`;
    :func:`_loaded_qkv` restores the ``[B, H, T, D]`` view). Where one holds NaN/inf (and so is kept exact), all three
    are: which scores are NaN depends on the others' exact values too (``-inf * 0`` is NaN, ``-inf`` times a restored
    ``1e-40`` is not)."""
    st = state or {}
    ctx.heads = (q.shape[1], k.shape[1], v.shape[1])
    # v by head: its channels are never contracted with another tensor's alone (the output's and grad_P's sums run
    # over all of them), so a small part of them costs no gradient its precision, and blocking v would copy it.
    qb, kb = head_blocks(q, cfg_q), head_blocks(k, cfg_kv)
    vb = kb if v is k else (v, cfg_kv)  # (the same view: packed once)
    items = [(*qb, st.get("q")), (*kb, st.get("k")), (*vb, st.get("v"))]
    packs = pack_many(items)
    # (kept as it is because autograd keeps it anyway, kept_whole: exact, no reason for the others to be; they kept
    # the fused projection's whole output alive, 1024 KiB where codes kept 448, a review)
    if any(p.meta.raw and not kept_whole(t) for p, (t, *_) in zip(packs, items, strict=True)) and not all(
            p.meta.raw for p in packs):
        for t in (q, k, v):  # (the codes just made are discarded: the shared-pack cache is not to hold them)
            forget_shared_packs(t)
        return pack_many([(t, None, None) for t in (q, k, v)])
    return packs


def _loaded_qkv(ctx, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The restored ``q``, ``k``, ``v`` of :func:`_pack_qkv` as ``[B, H, T, D]`` (a ``[B, T, H * D]`` one, packed by
    blocks of its heads, seen as heads again)."""
    return tuple(from_head_blocks(x, h) for x, h in zip((q, k, v), ctx.heads, strict=True))


def _grouped(probs: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, H, T, S]`` and ``[B, H_kv, S, D]`` as ``[B, H_kv, n_rep, T, S]`` and ``[B, H_kv, 1, S, D]``."""
    b, h, t, s = probs.shape
    h_kv = v.shape[1]
    return probs.reshape(b, h_kv, h // h_kv, t, s), v.unsqueeze(2)


class _SoftmaxDropoutMatmul(SlimFunction):
    layer = "attention (softmax, dropout, matmul)"

    @staticmethod
    def forward(ctx, scores, v, p, cfg_p, cfg_v, state_p, state_v):
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
        mask = None
        dropped = probs
        if p > 0:
            dropped, mask = torch.native_dropout(probs, p, True)
        pg, vg = _grouped(dropped, v)
        out = torch.matmul(pg, vg).reshape(*probs.shape[:-1], v.shape[-1])  # [B, H, T, D]
        ctx.scale = 1.0 / (1.0 - p) if 0 < p < 1 else (0.0 if p >= 1 else 1.0)
        ctx.dtype = scores.dtype
        kept_mask = None if mask is None else Mask.of(mask)
        packed = pack_probabilities(probs, cfg_p, state_p)
        ctx.lossy = packed.meta.derive is not None
        save(ctx, packed, kept_mask, pack(v, cfg_v, state_v))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        probs, mask, v = load(ctx)
        if ctx.lossy:
            probs = normalized(probs, -1)  # (see softmax.normalized)
        dropped = probs if mask is None else probs * mask * ctx.scale
        grad_scores = grad_v = None
        b, h, t, d = grad_out.shape
        gg = grad_out.reshape(b, v.shape[1], h // v.shape[1], t, d)  # [B, H_kv, n_rep, T, D]
        if ctx.needs_input_grad[1]:
            pg, _ = _grouped(dropped.to(grad_out.dtype), v)
            grad_v = pg.transpose(-1, -2).matmul(gg).sum(2)  # [B, H_kv, S, D]
        if ctx.needs_input_grad[0]:
            grad_d = gg.matmul(v.to(grad_out.dtype).unsqueeze(2).transpose(-1, -2)).reshape(probs.shape)
            grad_p = grad_d if mask is None else grad_d * mask * ctx.scale
            grad_scores = torch._softmax_backward_data(grad_p.to(probs.dtype), probs, -1, ctx.dtype)
        return grad_scores, grad_v, None, None, None, None, None


def softmax_dropout_matmul(
    scores: Tensor,
    v: Tensor,
    p: float,
    cfg_p: QuantConfig | None = None,
    cfg_v: QuantConfig | None = None,
    state_p: RunningRange | None = None,
    state_v: RunningRange | None = None,
) -> Tensor:
    """``dropout(softmax(scores, -1), p) @ v`` (``v`` may have fewer heads: grouped-query attention).

    Args:
        scores: ``[B, H, T, S]``; ``v``: ``[B, H_kv, S, D]`` with ``H`` a multiple of ``H_kv``.
        p: dropout probability (0 in eval mode).
        cfg_p, cfg_v: compression of the kept probabilities and values; ``None`` keeps them exact.
        state_p, state_v: their running estimates, for ``scale="running"``.
    """
    if not torch.is_grad_enabled() or not (scores.requires_grad or v.requires_grad):
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
        probs = torch.nn.functional.dropout(probs, p, p > 0)
        pg, vg = _grouped(probs, v)
        return torch.matmul(pg, vg).reshape(*probs.shape[:-1], v.shape[-1])
    return _SoftmaxDropoutMatmul.apply(scores, v, p, cfg_p, cfg_v, state_p, state_v)


# ---------------------------------------------------------------------------------------------------------
# Fused scaled-dot-product attention keeping no [T, S] tensor.


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``attn_mask`` as an additive float mask (bool ``True`` = attend; masked = -inf, as PyTorch converts it: the
    dtype's minimum let a masked key whose score is +inf, an inf in q or k, take the whole row, a finite and
    wrong output where PyTorch's is NaN). A fully masked row is handled by :func:`_probabilities` and the kernels."""
    if mask is None or mask.dtype != torch.bool:
        return mask if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def _probabilities(scores: Tensor, future: Tensor | None = None, sink: Tensor | None = None) -> Tensor:
    """Softmax over the last dim as ``torch.softmax`` computes it, ``exp(s - max) / sum``, with 0 for a row of
    -inf only (fully masked), as PyTorch's CPU flash kernel has it. Not ``exp(s - lse)``: ``lse`` rounded in
    fp32 next to scores of 1e8 (fp16 inputs with outliers) was off by most of its ulp of 8, and two tied keys
    got 0.47 each instead of 0.5. ``future``: a causal mask given by each row's last visible key (``[rows, 1]``
    fp32, exact integers): keys beyond it are set to -inf first, as ``masked_fill`` would (whatever the score),
    in the same compiled loop, the key index an iota of the loop (no ``[rows, S]`` mask in memory, no pass of its
    own over the scores). (fp32, not bool: inductor's CPU loops read a broadcast bool mask element by element,
    2.5x slower than the unmasked loop; the fp32 comparison vectorises.) ``sink``: each head's attention-sink logit
    (fp32, ``[..., 1, 1]`` broadcast to the rows), one more term of each row's sum whose probability is dropped: the
    row sums to ``1 - exp(sink - lse)``, a fully masked row to 0."""
    if future is not None:
        keys = torch.arange(scores.shape[-1], dtype=torch.float32, device=scores.device)  # [S]
        scores = torch.where(keys > future, float("-inf"), scores)
    m = scores.amax(-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)
    e = torch.exp(scores - m.masked_fill(torch.isneginf(m), 0.0))
    total = e.sum(-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - m)
    return e / total.masked_fill(total == 0, 1.0)


def _dropped_probabilities(scores: Tensor, future: Tensor | None, keep: Tensor, scale: float,
                           sink: Tensor | None = None) -> Tensor:
    """``native_dropout(softmax(scores), p)`` from its mask ``keep`` (0/1 uint8) and ``scale = 1 / (1 - p)``:
    the CPU kernel's ``(x * mask) * scale``, the same values bit for bit, in the probabilities' own loop (no fp32
    mask, no two multiplying passes over ``[B, H, T, S]``). uint8, not bool: the loop reads a bool mask element
    by element (twice the loop's time), a uint8 one vectorised."""
    return _probabilities(scores, future, sink) * keep * scale


def _rows_backward(scores: Tensor, future: Tensor | None, dp: Tensor, keep: Tensor | None,
                   scale: float, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(D, dS)`` of a block of whole rows from its fp32 scores (causally masked by ``future`` if given, as
    :func:`_probabilities`), the gradient of its dropped probabilities
    ``dp`` and the dropout's mask ``keep`` (0/1 uint8, ``None`` without dropout) and factor ``scale``:
    ``P = softmax(scores)``, ``D = P * keep * scale``, ``dS = P * (dp * keep * scale - rowsum(P * dp * keep *
    scale))`` (run through :func:`_fused_rows`; ``(x * keep) * scale`` is the forward's dropout bit for bit). With a
    ``sink`` (:func:`_probabilities`) the same formula: the sink's own probability has no gradient of its own (it
    meets no value), so the row sum is still ``rowsum(P * dP)`` over the keys."""
    # rowsum(P * dP) from the block's own fp32 rows (each block holds whole rows): so ds sums to zero over a row
    # to fp32 rounding. (FlashAttention's rowsum(dO * O) from the output rounded to fp16 left a 1e-3 residue,
    # which constant keys turned into a q gradient of 1e-3 where the exact one is 0.)
    probs = _probabilities(scores, future, sink)
    dropped = probs if keep is None else probs * keep * scale
    dp = dp if keep is None else dp * keep * scale
    return dropped, probs * (dp - (probs * dp).sum(-1, keepdim=True))


def _rows_backward_in_place(scores: Tensor, future: Tensor | None, dp: Tensor, keep: Tensor | None,
                            scale: float, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`_rows_backward` written over its inputs, ``D`` into ``scores`` and ``dS`` into ``dp`` (the compiled
    loop reads each row before writing it): two ``[B, H, rows, S]`` tensors fewer alive in the backward's row
    loop, where a block's scores and ``dP`` are not read again."""
    dropped, ds = _rows_backward(scores, future, dp, keep, scale, sink)
    return scores.copy_(dropped), dp.copy_(ds)


def _rows_backward_ds_in_place(scores: Tensor, future: Tensor | None, dp: Tensor, keep: Tensor | None,
                               scale: float, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`_rows_backward` writing ``dS`` over ``dp`` only (``D`` a new tensor), for rows without a causal
    limit: there torch 2.13's inductor CPU codegen fails on :func:`_rows_backward_in_place` (``KeyError: 'buf1'``
    in its outer-loop fusion with a local buffer, whether or not there is dropout), and a failed compile leaves
    the loop eager for the rest of the process (about 15 passes a block) with a RuntimeWarning."""
    dropped, ds = _rows_backward(scores, future, dp, keep, scale, sink)
    return dropped, dp.copy_(ds)


def _fused_rows(fn, scores: Tensor, *args: Tensor | None):
    """``fn(scores, *args)``, a row-wise computation over ``[..., rows, S]`` blocks, as compiled loops where the
    block is large (:func:`slimact.quant.inductor.fused`: one loop per row pass instead of one eager pass per
    op, about 15 for the backward's rows), else eagerly: the same math."""
    return inductor.fused_or_eager(fn, (fn.__name__, scores.dtype, *(a is None for a in args)), scores, *args)


def _dead(mask: Tensor) -> Tensor:
    """``[..., T, 1]``: the query rows a mask allows nothing in (all False, or all -inf), not read."""
    return (~mask.any(-1) if mask.dtype == torch.bool else torch.isneginf(mask).all(-1)).unsqueeze(-1)


#: An additive mask row whose every entry is at or below this is masked with a finite fill (Hugging Face's
#: ``finfo.min``, ``-1e9``, ``-1e4``). PyTorch's math path computes that row's softmax from the fill-dominated scores
#: (at ``finfo.min`` a uniform row, 1/S each) and differentiates the probabilities it computed. The fused kernels
#: (the CPU flash kernel, CUDA's) recompute the probabilities in their backward as ``exp(score - lse)`` with the
#: fp32 log-sum-exp of that magnitude, which keeps ``log(sum)`` only to within half an ulp of the fill: at -1e4 a
#: relative 1e-4, at ``finfo.min`` nothing of it (each probability comes back 1 instead of 1/S, the q, k, v
#: gradients off by up to S times; a Falcon with ALiBi and left padding: 4x to 11x). Such calls take the chunked
#: path, which recomputes each row's softmax as the math path does.
SWAMPED_FILL = -1024.0


def _swamped(mask: Tensor) -> Tensor:
    """A 0-dim bool tensor (not read): whether an additive ``mask`` has a row masked with a finite fill only (its
    maximum at or below :data:`SWAMPED_FILL`, not -inf: a row of -inf is a dead row, which the kernels handle)."""
    if mask.dtype == torch.bool or mask.shape[-1] == 0:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    top = mask.detach().amax(-1)
    return ((top <= SWAMPED_FILL) & (top > -math.inf)).any()


def _dead_rows(mask: Tensor | None) -> Tensor | None:
    """Query rows a mask allows nothing in (all False, or all -inf): PyTorch gives them 0, and 0 gradients."""
    if mask is None:
        return None
    dead = _dead(mask)
    # Under torch.compile the mask is applied whether or not a row is dead (no host sync in the graph).
    return dead if torch.compiler.is_compiling() or bool(dead.any()) else None  # [..., T, 1]


def _saved_mask(mask: Tensor | None, one_fill: bool | None = None) -> Mask | Tensor | None:
    """What to keep of an attention mask (:func:`_mask_bits`; ``one_fill``: whether it is an additive mask of one
    fill value, if the caller read it), the same object for every call of one forward handed the same mask, or a
    view of it at the same place (transformers slices it per layer): a model builds one mask (per layer type) and
    hands it to every layer, which PyTorch keeps once; bits made per call were kept once per layer (L/8 of the
    mask's bytes: a 32-layer Llama with a padded batch kept 4x plain's). Under ``torch.compile`` and outside a
    converted model's forward, made per call."""
    if mask is None:
        return None
    key, kept = _kept_mask(mask)
    if kept is None:
        kept = _mask_bits(mask, one_fill)
        if key is not None:
            # The entry lives with the tensor that owns the memory (a view dies with its call; the owner outlives the
            # layers), one per place: the next forward's replaces it (a mask buffer of the model's, alive for the
            # whole run, would otherwise gather one entry per step).
            owner = mask if mask._base is None else mask._base
            ref = weakref.ref(owner, functools.partial(_forget_mask, _kept_masks, key))
            _kept_masks[key] = (ref, mask._version, reference.current_stream(), kept)
    return kept


#: Where a mask lies (:func:`_kept_mask`) -> (weak reference to the mask's owner, its version, the forward stream,
#: what is kept of it): :func:`_saved_mask`.
_kept_masks: dict[tuple, tuple] = {}


def _forget_mask(masks: dict, key: tuple, ref: weakref.ref) -> None:
    """Drop the entry of ``key`` from ``masks`` (:data:`_kept_masks`, bound by the callback: at interpreter exit an
    owner can die after this module's globals are cleared) when its owner dies, not a later entry of the same
    place, made for another owner."""
    entry = masks.get(key)
    if entry is not None and entry[0] is ref:
        del masks[key]


def _kept_mask(mask: Tensor) -> tuple[tuple | None, Mask | Tensor | None]:
    """The key of ``mask`` in :data:`_kept_masks` (``None`` where nothing is shared: outside a converted model's
    forward, under ``torch.compile``) and what this forward already keeps of it (``None`` if nothing)."""
    stream = reference.current_stream()
    if stream is None or torch.compiler.is_compiling():
        return None, None
    key = storage_key(mask)
    hit = _kept_masks.get(key)
    owner = None if hit is None else hit[0]()
    if owner is None or hit[1] != mask._version or hit[2] is not stream:
        return key, None
    if owner.untyped_storage().data_ptr() != key[1]:
        # The owner lives on, its memory released or swapped (``storage().resize_(0)``, ``.data = ...``), and the
        # allocator gave the address to this mask: another tensor, of other values (quant.core._SharedPacks.get).
        return key, None
    return key, hit[3]


def _own(mask: Tensor) -> Tensor:
    """A broadcast (expanded: stride 0) mask's own elements, its broadcast dims at size 1."""
    return mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.stride())]


def _fill(own: Tensor) -> Tensor:
    """An additive mask's fill value: its minimum (0-dim)."""
    return own.amin() if own.numel() else own.new_zeros(())


def _one_fill(own: Tensor, fill: Tensor) -> Tensor:
    """Whether an additive mask holds 0 and ``fill`` alone (a 0-dim bool tensor, not read)."""
    return ((own == 0) | (own == fill)).all()


def _mask_bits(mask: Tensor, one_fill: bool | None = None) -> Mask | Tensor:
    """An attention mask as bits where it is boolean or an additive mask of 0 and one fill value (transformers' eager
    masks, ``finfo.min`` where masked: 1/32 of its fp32 bytes), restored exactly; a broadcast (expanded) mask by its
    own elements (bits of the expanded shape could outgrow the mask). Other additive masks (a position bias, ALiBi),
    one that needs a gradient, and additive ones under ``torch.compile`` (no host read in the graph), as they are.
    Whether an additive mask has one fill value is read on the host (``one_fill`` where the caller read it with its
    other flags)."""
    if mask.requires_grad or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return mask
    own = _own(mask)
    full = mask.shape if own.shape != mask.shape else None
    if mask.dtype == torch.bool:
        return Mask(pack_mask(own), own.shape, None, full)
    if torch.compiler.is_compiling():
        return mask
    fill = _fill(own)
    if not (bool(_one_fill(own, fill)) if one_fill is None else one_fill):
        return mask
    return Mask(pack_mask(own == fill), own.shape, fill, full)


def _sunk(out: Tensor, lse: Tensor, sinks: Tensor | None, dead: Tensor | None) -> tuple[Tensor, Tensor]:
    """A kernel's output and log-sum-exp with attention sinks: ``o' = o * sigmoid(lse - sink)``, ``lse' =
    logaddexp(lse, sink)`` (each head's sink one more logit of every row, meeting no value). The kernels' backward
    recomputes the probabilities as ``exp(s - lse')`` and the row sum ``rowsum(dO * o')`` from what it is given, so
    handed ``o'`` and ``lse'`` it differentiates the attention with the sinks. ``out`` ``[B, H, T, Dv]`` is written
    in place (its layout kept: the efficient kernel's backward reads it with the strides it returned); ``lse``
    ``[B, H, T']`` fp32 (``T' >= T``: the efficient kernel pads it), a new tensor. Fully masked rows (``dead``) keep
    the kernel's log-sum-exp (zeroed outputs, no gradient)."""
    if sinks is None:
        return out, lse
    t = out.shape[2]
    sink = sinks.detach().float().view(1, -1, 1)  # [1, H, 1]
    rows = lse[..., :t]
    sunk = torch.logaddexp(rows, sink)
    out.copy_(out.float() * torch.exp(rows - sunk).unsqueeze(-1))
    if dead is not None:
        sunk = torch.where(dead.squeeze(-1), rows, sunk)
    lse = lse.clone()
    lse[..., :t] = sunk
    return out, lse


def _sinks_grad(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor, dead: Tensor | None) -> Tensor:
    """The sinks' gradient from :func:`_sunk`'s output and log-sum-exp: a sink's probability ``exp(sink - lse')``
    times ``-rowsum(dO * o')`` (the softmax's gradient sums to 0 over a row, sink included), summed over batch and
    rows. ``[H]`` in the sinks' dtype; fully masked rows (``dead``) give nothing."""
    t = out.shape[2]
    p_sink = torch.exp(sinks.detach().float().view(1, -1, 1) - lse[..., :t])  # [B, H, T]
    rows = (grad_out.float() * out.float()).sum(-1)
    if dead is not None:
        p_sink = p_sink.masked_fill(dead.squeeze(-1), 0.0)
    return -(p_sink * rows).sum((0, 2)).to(sinks.dtype)


def _check_sinks(sinks: Tensor | None, heads: int) -> None:
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != heads or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be one floating-point logit per query head, shape ({heads},); got "
                         f"{tuple(sinks.shape)} {sinks.dtype}")


_FLASH_CPU = "_scaled_dot_product_flash_attention_for_cpu"


def _flash_cpu_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``mask`` as the CPU flash kernel's additive ``attn_mask``, which takes 2 or 4 dims only: a ``[H, T, S]`` or
    ``[1, T, S]`` mask (which ``F.scaled_dot_product_attention`` broadcasts, right-aligned) seen as ``[1, H, T, S]``
    (the kernel raised "Attention mask dim in {2, 4}" where the plain call ran). An fp32 mask with bf16 q, k, v
    stays fp32, as the plain call hands it to the kernel (cast to bf16 first, outputs were 1 bf16 ulp off plain's)."""
    add = mask if mask is not None and mask.dtype == torch.float32 else _additive(mask, dtype)
    return add[None] if add is not None and add.dim() == 3 else add


class _FlashAttentionCPU(SlimFunction):
    """PyTorch's CPU flash kernel forward and backward, with q, k, v, out kept packed and lse exact."""

    layer = "attention (CPU flash)"

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, cfg_q, cfg_kv, state, sinks=None, one_fill=None):
        # The kernel reads the head dim as contiguous (PyTorch's dispatcher picks it only when the last dim has
        # stride 1): a transposed view gave a wrong output, up to 1e33. What is kept (and the backward kernel
        # reads) is this copy too.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        add = _flash_cpu_mask(mask, q.dtype)
        out, lse = getattr(torch.ops.aten, _FLASH_CPU)(q, k, v, 0.0, is_causal, attn_mask=add, scale=scale)
        dead = _dead_rows(mask)
        out, lse = _sunk(out, lse, sinks, dead)
        if dead is not None:
            out = out.masked_fill(dead, 0)
        ctx.is_causal, ctx.scale, ctx.dtype = is_causal, scale, q.dtype
        exact = cfg_q is None  # lossless: keep the output and lse; 8-bit: recompute them from q, k, v
        save(ctx, *_pack_qkv(ctx, q, k, v, cfg_q, cfg_kv, state),
             out if exact else None, lse if exact else None, _saved_mask(mask, one_fill), dead, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask, dead, sinks = load(ctx)
        q, k, v = _loaded_qkv(ctx, q, k, v)
        add = _flash_cpu_mask(mask, ctx.dtype)
        if out is None:  # the output and lse of the restored q, k, v: a self-consistent backward
            out, lse = getattr(torch.ops.aten, _FLASH_CPU)(q, k, v, 0.0, ctx.is_causal, attn_mask=add, scale=ctx.scale)
            out, lse = _sunk(out, lse, sinks, dead)
        if dead is not None:
            grad_out = grad_out.masked_fill(dead, 0)
        gq, gk, gv = getattr(torch.ops.aten, _FLASH_CPU + "_backward")(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=add, scale=ctx.scale,
        )
        gs = _sinks_grad(grad_out, out, lse, sinks, dead) if sinks is not None and ctx.needs_input_grad[9] else None
        return gq, gk, gv, None, None, None, None, None, None, gs, None


#: Query rows per block of the chunked path (its transient scores are [B, H, rows, S]).
CHUNK_ROWS = 256


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _replaying(state: Tensor | None, device: torch.device):
    """Runs its block on a forked generator set to ``state`` (a :func:`_rng_state` snapshot): the draws made
    there are those made after the snapshot; the generator is left as it was. ``state=None``: no fork."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


def _refuse_vmap_mode(layer: str) -> None:
    """A clear error where the backward runs in the vmap mode of ``torch.autograd.grad(..., is_grads_batched=True)``
    (and ``jacobian(vectorize=True)``): the redraw of the forward's dropout mask is a random op, which that mode
    refuses ("vmap: We do not yet support calling random operations inside of vmap"), and the chunked backward's
    in-place row loop has no batching rule there either. Plain PyTorch, which keeps the mask, runs it."""
    depth = torch._C._vmapmode_increment_nesting() - 1  # (the only way to read the nesting: up one, then down)
    torch._C._vmapmode_decrement_nesting()
    if depth:
        raise RuntimeError(
            f"slimact's {layer} with dropout cannot run its backward batched (torch.autograd.grad(..., "
            "is_grads_batched=True), torch.autograd.functional.jacobian(..., vectorize=True)): it redraws the "
            "forward's dropout mask, a random op that batched backward refuses. Run that pass in eval mode or with "
            "dropout_p=0, without vectorize/is_grads_batched, or leave attention out of the conversion "
            "(slimact.convert(model, filter_fn=...), or the policy's per-kind settings).")


def _bool_draw(device: torch.device, p: float) -> bool:
    """Whether ``native_dropout``'s mask is ``empty(uint8).bernoulli_(1 - p)``'s draw: on the CPU, where the
    kernel draws its mask with ``bernoulli_`` on a tensor of the input's dtype and that draw is one Bernoulli of
    the generator's serial stream per element, whatever the tensor's dtype (checked bit for bit, generator
    state after it too, at 1 and 2 threads: ``tests/functional/test_attention.py``); 0 < p < 1."""
    return device.type == "cpu" and 0.0 < p < 1.0


def _replayed_mask(state: Tensor, shape: tuple[int, ...], dtype: torch.dtype, p: float, device) -> Tensor:
    """The mask ``native_dropout`` drew (on a tensor of ``dtype``) from RNG ``state``, drawn again, as 0/1
    uint8 (:func:`_dropped_probabilities`): on the CPU straight into a uint8 tensor on a generator of its own set
    to ``state`` (no fp32 noise, no multiply, the default generator untouched), by slimact's vectorised
    ``bernoulli_`` (:mod:`slimact.functional._bernoulli`: the same stream, 3-5x the serial kernel's speed);
    elsewhere by ``native_dropout`` on ones on a forked generator."""
    device = torch.device(device)
    if _bool_draw(device, p):
        gen = torch.Generator()
        gen.set_state(state)
        return bernoulli_(torch.empty(shape, dtype=torch.uint8), 1.0 - p, gen)
    with _replaying(state, device):
        return torch.native_dropout(torch.ones(shape, dtype=dtype, device=device), p, True)[1].view(torch.uint8)


class _ChunkedAttention(SlimFunction):
    """Flash-style attention in PyTorch ops, a block of query rows at a time, on any device.

    Keeps q, k, v (packed, or exact under a lossless policy) and, with dropout, the RNG state it drew the mask
    from, so the backward redraws the same mask: nothing of size [T, S] is ever kept, nor the output (the
    backward takes ``rowsum(P * dP)`` from the rows it recomputes).
    """

    layer = "attention (chunked)"

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, dropout_p, cfg_q, cfg_kv, state, math_forward=False,
                sinks=None, one_fill=None):
        b, h, t, d = q.shape
        h_kv, s = k.shape[1], k.shape[2]
        add = _additive(mask, torch.float32)
        sink = None if sinks is None else sinks.detach().float().view(1, h, 1, 1)  # each row's extra logit
        # q scaled before the product: a pass over [B, H, T, D], not over the [B, H, T, S] scores (for a power of
        # two, as head size 64's 1/8, the very same scores)
        qs = _scaled_queries(q, scale).reshape(b, h_kv, h // h_kv, t, d)
        kt, vg = k.unsqueeze(2).transpose(-1, -2), v.unsqueeze(2)
        # On the CPU, fp16/bf16 probabilities meet v in fp32, the output rounded once: as PyTorch's math kernel
        # computes them (its attention in fp32 throughout), which F.scaled_dot_product_attention runs where this
        # path is taken (dropout, value heads of another width). Rounding the probabilities to the inputs' dtype
        # first left outputs 1 ulp off plain's (bf16 with dropout: 7.8e-3 at values near 1.7).
        v32 = vg.float() if q.device.type == "cpu" else vg
        rng = _rng_state(q.device) if dropout_p > 0 else None
        if math_forward and dropout_p == 0.0:
            # PyTorch's own call runs its math kernel here (_math_chosen): that very op gives the very output, where
            # the blocks below differ from it by an ulp (q scaled once, not q and k by sqrt(scale) each; fp32 with
            # a learned [H, T, S] bias: 1.5e-7). Its [B, H, T, S] scores are transient, as in the plain call. A
            # boolean mask is handed over as F.scaled_dot_product_attention hands it (-inf where False, 0 elsewhere,
            # q's dtype): the op reads a boolean one otherwise (outputs 1.0 off).
            given = _additive(mask, q.dtype) if mask is not None and mask.dtype == torch.bool else mask
            out = torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, given, 0.0, is_causal, scale=scale, enable_gqa=h != h_kv)[0]
        elif dropout_p > 0:
            # One draw over the whole [B, H, T, S] grid, as eager F.dropout makes it (same masks as the plain
            # model); the backward replays it from the snapshot. Transient here, never kept.
            scores, future = _block_scores(qs, kt, add, is_causal, (b, h, t, s), 0, t)
            if _bool_draw(q.device, dropout_p):
                # native_dropout's draw (the same generator advance), its multiply in the probabilities' loop
                keep = bernoulli_(torch.empty(scores.shape, dtype=torch.uint8), 1.0 - dropout_p)
                dropped = _fused_rows(_dropped_probabilities, scores, future, keep, cpu_scale(dropout_p, torch.float32),
                                      sink)
            else:
                probs = _fused_rows(_probabilities, scores, future, sink).to(v.dtype)
                dropped, _ = torch.native_dropout(probs, dropout_p, True)
            out = torch.matmul(dropped.reshape(b, h_kv, h // h_kv, t, s), v32 if dropped.dtype != v.dtype else vg)
            out = out.reshape(b, h, t, v.shape[-1]).to(v.dtype)
        else:
            out = torch.empty(b, h, t, v.shape[-1], dtype=q.dtype, device=q.device)
            for t0 in range(0, t, CHUNK_ROWS):
                t1 = min(t, t0 + CHUNK_ROWS)
                scores, future = _block_scores(qs[..., t0:t1, :], kt, add, is_causal, (b, h, t, s), t0, t1)
                pg = _fused_rows(_probabilities, scores, future, sink).to(v32.dtype)
                pg = pg.reshape(b, h_kv, h // h_kv, t1 - t0, s)
                out[:, :, t0:t1] = torch.matmul(pg, v32).reshape(b, h, t1 - t0, v.shape[-1])
        dead = _dead_rows(mask)
        if dead is not None:
            out = out.masked_fill(dead, 0)
        ctx.args = (is_causal, scale, dropout_p, v.dtype)
        save(ctx, *_pack_qkv(ctx, q, k, v, cfg_q, cfg_kv, state), _saved_mask(mask, one_fill), dead, rng, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, dead, rng, sinks = load(ctx)
        q, k, v = _loaded_qkv(ctx, q, k, v)
        is_causal, scale, dropout_p, p_dtype = ctx.args
        if dead is not None:
            grad_out = grad_out.masked_fill(dead, 0)
        b, h, t, d = q.shape
        h_kv, s = k.shape[1], k.shape[2]
        rep = h // h_kv
        add = _additive(mask, torch.float32)
        qs = _scaled_queries(q, scale).reshape(b, h_kv, rep, t, d)  # as the forward scaled it
        # k and the output's gradient each feed two products: laid out for them once (each product would copy a
        # transposed [B, T, H, D] view itself)
        kf, vf = k.float().contiguous(), v.float()
        kt, vg = kf.unsqueeze(2).transpose(-1, -2), vf.unsqueeze(2)
        g = grad_out.float().contiguous()
        # Each block's products are new tensors: the first block's are the sums' start (0 + a is a, exactly),
        # and a single block's q gradient is the whole one (no zeros, no copy into a buffer).
        gq = torch.empty_like(qs) if t > CHUNK_ROWS else None
        gk = gv = None
        gg = g.reshape(b, h_kv, rep, t, v.shape[-1])
        # [B, H, T, S] 0/1 uint8, drawn as the forward drew it (in p_dtype), and the dropout's factor
        if rng is not None:
            _refuse_vmap_mode("attention")
        keep_all = _replayed_mask(rng, (b, h, t, s), p_dtype, dropout_p, q.device) if rng is not None else None
        # (on the CPU the factor F.dropout's fp32 noise has, as the forward applied it)
        factor = scale_of(q.device, dropout_p, torch.float32)
        # A learned additive mask (Swin's and T5's position biases): its gradient is the scores' gradient,
        # summed over the dims it broadcasts along. [B|1, H|1, T|1, S]
        need_mask_grad = ctx.needs_input_grad[3]
        m4 = None if not need_mask_grad else mask.view(*(1,) * (4 - mask.dim()), *mask.shape)
        gmask = torch.zeros(m4.shape, dtype=torch.float32, device=q.device) if need_mask_grad else None
        sink = None if sinks is None else sinks.detach().float().view(1, h_kv, rep, 1, 1)
        # A sink's gradient is minus the sum of its row's score gradients (a row's softmax gradient sums to 0, the
        # sink's entry included), summed over batch and rows: [H_kv, rep]
        gsink = None
        if sinks is not None and ctx.needs_input_grad[11]:
            gsink = torch.zeros(h_kv, rep, dtype=torch.float32, device=q.device)
        for t0 in range(0, t, CHUNK_ROWS):
            t1 = min(t, t0 + CHUNK_ROWS)
            scores, future = _block_scores(qs[..., t0:t1, :], kt, add, is_causal, (b, h, t, s), t0, t1)
            scores = scores.reshape(b, h_kv, rep, t1 - t0, s)
            gblk = gg[..., t0:t1, :]
            dp = gblk.matmul(vg.transpose(-1, -2))  # [B, H_kv, rep, rows, S]
            keep = None if keep_all is None else keep_all[:, :, t0:t1].reshape(b, h_kv, rep, t1 - t0, s)
            rows_fn = _rows_backward_in_place if future is not None else _rows_backward_ds_in_place
            dropped, ds = _fused_rows(rows_fn, scores, future, dp, keep, factor, sink)
            scores = dp = None
            if gsink is not None:
                gsink -= ds.sum((0, 3, 4))
            gv_blk = dropped.transpose(-1, -2).matmul(gblk)
            gv = gv_blk if gv is None else gv.add_(gv_blk)
            if gmask is not None:
                gm = ds.reshape(b, h, t1 - t0, s)
                # (the rows' dim, 2, is summed below; the keys' too where the mask broadcasts along them, [H, T, 1])
                dims = [i for i in (0, 1, 3) if m4.shape[i] == 1 and gm.shape[i] != 1]
                gm = gm.sum(dims, keepdim=True) if dims else gm  # (an empty list would sum everything)
                if m4.shape[2] == 1:
                    gmask += gm.sum(2, keepdim=True)
                else:
                    gmask[:, :, t0:t1] += gm
            gq_blk = ds.matmul(kf.unsqueeze(2)).mul_(scale)
            if gq is None:
                gq = gq_blk
            else:
                gq[..., t0:t1, :] = gq_blk
            gk_blk = ds.transpose(-1, -2).matmul(qs[..., t0:t1, :])  # (scale q)'s rows: scale's product
            gk = gk_blk if gk is None else gk.add_(gk_blk)
        if gk is None:  # no query rows
            gq = torch.empty_like(qs)
            gk = torch.zeros(b, h_kv, rep, s, d, dtype=torch.float32, device=q.device)
            gv = torch.zeros(b, h_kv, rep, s, v.shape[-1], dtype=torch.float32, device=q.device)
        grad_mask = gmask.reshape(mask.shape).to(mask.dtype) if gmask is not None else None
        # Summed over each group's heads (a dim of one without grouping: a view, not a summing copy).
        gk, gv = (x.squeeze(2) if rep == 1 else x.sum(2) for x in (gk, gv))
        grad_sinks = gsink.reshape(h).to(sinks.dtype) if gsink is not None else None
        return (gq.reshape(b, h, t, d).to(q.dtype), gk.to(k.dtype), gv.to(v.dtype),
                grad_mask, None, None, None, None, None, None, None, grad_sinks, None)


def _scaled_queries(q: Tensor, scale: float) -> Tensor:
    """``q * scale`` in fp32, written contiguous (``[B, H, T, D]``): the products read it with no copy of their
    own (a model's ``q`` is usually a transposed ``[B, T, H, D]`` view, which each product would copy)."""
    return torch.mul(q.float(), scale, out=torch.empty(q.shape, dtype=torch.float32, device=q.device))


def _block_scores(qs, kt, add, is_causal, shape, t0, t1) -> tuple[Tensor, Tensor | None]:
    """fp32 scores of query rows ``t0:t1`` from the scaled fp32 queries ``qs`` (``[B, H_kv, rep, rows, D]``):
    ``[B, H_kv, rep, rows, S]`` flattened to ``[B, H, rows, S]``, and the causal limit of those rows (``[rows,
    1]`` fp32, each row's last visible key; ``None`` if not causal), which the row loops apply
    (:func:`_probabilities`)."""
    b, h, t, s = shape
    # The product is a new tensor: offset in place (no copy of [B, H, rows, S] per step).
    scores = torch.matmul(qs, kt.float()).reshape(b, h, t1 - t0, s)
    if add is not None:
        m = add if add.dim() == 4 else add.view(*(1,) * (4 - add.dim()), *add.shape)
        rows = m[..., t0:t1, :] if m.shape[-2] == t else m
        fits = torch.broadcast_shapes(rows.shape, scores.shape) == scores.shape
        scores = scores.add_(rows) if fits else scores + rows
    future = None
    if is_causal:
        # query t0 + i sees keys j <= t0 + i (top-left aligned, as PyTorch's is_causal)
        future = torch.arange(t0, t1, dtype=torch.float32, device=scores.device).unsqueeze(-1)  # [rows, 1]
    return scores, future


# ---------------------------------------------------------------------------------------------------------
# PyTorch's fused CUDA kernels (FlashAttention-2, memory-efficient attention), forward and backward.

#: The fused CUDA kernels by kind: (forward, backward), as names of ``torch.ops.aten`` ops (looked up when
#: called) or as callables with their signatures (a test substitutes CPU emulations here).
FUSED_OPS: dict[str, tuple[str | Callable, str | Callable]] = {
    "flash": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
    "efficient": ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
}

#: Last-dim alignment, in elements, of the memory-efficient kernel's ``attn_bias`` (its rows start on 16-byte
#: boundaries: 4 fp32 or 8 fp16 elements; 16 covers both with room): the bias is built in a padded buffer.
BIAS_ALIGN = 16


def _op(kind: str, which: int) -> Callable:
    op = FUSED_OPS[kind][which]
    return getattr(torch.ops.aten, op) if isinstance(op, str) else op


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability``, asked once per device (a tensor's: its index given), not twice per call."""
    return torch.cuda.get_device_capability(device)


def _fused_device(device: torch.device) -> bool:
    """Whether PyTorch's fused CUDA kernels are taken on ``device``: CUDA, compute capability 8.0 or more (the
    flash kernel's bf16 needs it; older devices take the chunked path)."""
    return device.type == "cuda" and _capability(device) >= (8, 0)


def _max_head_dim(device: torch.device) -> int:
    """Head sizes both kernels take forward and backward: 256 on sm80/sm90 (A100, H100/H200), 128 elsewhere
    (FlashAttention-2's backward takes no head size above 192 on sm86/sm89)."""
    if device.type != "cuda":
        return 256
    return 256 if _capability(device) in ((8, 0), (9, 0)) else 128


def _finite(query: Tensor, key: Tensor) -> bool:
    """Whether ``query`` and ``key`` hold no NaN/inf (one host sync for both; detached, so that it records no
    graph). Under torch.compile, where the sync would break the graph, ``True``: the kernel is taken as it is."""
    if torch.compiler.is_compiling():
        return True
    return bool(torch.isfinite(query.detach()).all() & torch.isfinite(key.detach()).all())


def fused_kernel(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                 is_causal: bool, mask_grad: bool) -> str | None:
    """Which fused CUDA kernel :func:`scaled_dot_product_attention` runs: ``"flash"`` (fp16/bf16, no mask),
    ``"efficient"`` (fp32 too, an additive bias), or ``None`` for the chunked path (or, on CPU, its flash
    kernel). Conservative: anything the kernels may not take, or may take wrongly, is ``None``: also a NaN/inf
    in a query or key (how the kernels' running max treats NaN scores is theirs (fmax drops NaN); the chunked
    path gives NaN where the math does)."""
    kind = _fused_kind(query, key, value, attn_mask, dropout_p, is_causal, mask_grad)
    return kind if kind is None or _finite(query, key) else None


def _not_finite(query: Tensor, key: Tensor) -> Tensor:
    """A 0-dim bool tensor on their device: whether ``query`` or ``key`` holds a NaN/inf (not read).

    From one fp32 sum of each: a NaN/inf anywhere makes the total NaN or +-inf, and ``t - t`` is 0 only for a
    finite ``t``. Five launches reading each tensor once (``isfinite`` of both and their ``all`` were twelve, with
    eight full-size passes). Where a sum of finite values overflows fp32 (``|total| > 3.4e38``) finite tensors are
    flagged too: they take the chunked path, exact, as non-finite ones do (slower, never wrong)."""
    total = query.detach().sum(dtype=torch.float32) + key.detach().sum(dtype=torch.float32)
    return (total - total) != 0


def _math_chosen(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                 is_causal: bool, scale: float, enable_gqa: bool) -> bool:
    """Whether ``F.scaled_dot_product_attention`` on the CPU, without dropout, runs PyTorch's math kernel for these
    arguments (a mask that needs a gradient; a mask of a shape its CPU flash kernel refuses, ``[H, T, S]``): its
    own choice (``aten._fused_sdp_choice``), so the forward is its output bit for bit. With dropout (always the math
    kernel in PyTorch) the chunked path keeps its own forward, within float rounding of PyTorch's (2.4e-7 in fp32):
    its draw and masking run in its compiled loops, where the math kernel's are a serial fp32 draw and two passes
    over [B, H, T, S] (docs/attention.md)."""
    if dropout_p != 0.0 or query.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    choice = torch.ops.aten._fused_sdp_choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    return choice == SDPBackend.MATH.value


def _fused_kind(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                is_causal: bool, mask_grad: bool) -> str | None:
    """:func:`fused_kernel` but for the NaN/inf check (which reads the device: the caller reads it)."""
    if mask_grad or not _fused_device(query.device):
        return None
    dtype = query.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (key.dtype == value.dtype == dtype):
        return None
    if not (key.device == value.device == query.device) or (attn_mask is not None and attn_mask.device != query.device):
        return None
    (b, h, t, d), (h_kv, s) = query.shape, key.shape[1:3]
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[-1] != d or value.shape[-1] != d:
        return None  # broadcast batches, value heads of another size: as written, by the chunked path
    if h % h_kv or min(b, h, t, s) == 0 or d % 8 or d > _max_head_dim(query.device) or max(b, h) > 65535:
        return None
    if not 0.0 <= dropout_p < 1.0:
        return None
    if attn_mask is not None:
        if attn_mask.dim() > 4 or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
            return None
        try:
            if torch.broadcast_shapes(attn_mask.shape, (b, h, t, s)) != (b, h, t, s):
                return None
        except RuntimeError:
            return None
    # FlashAttention's is_causal is bottom-right aligned for T != S; PyTorch's (and the efficient kernel's) is
    # top-left: only a square causal attention runs flash.
    if attn_mask is None and dtype != torch.float32 and not (is_causal and t != s):
        return "flash"
    return "efficient"


def _aligned_bias(mask: Tensor | None, dtype: torch.dtype, dead: Tensor | None,
                  shape: tuple[int, int, int, int]) -> Tensor | None:
    """``mask`` as the efficient kernel's ``attn_bias``: additive (``_additive``), in ``dtype``, its rows in a
    buffer padded to :data:`BIAS_ALIGN` elements, expanded (a view) to ``[B, H, T, S]``. Fully masked rows
    (``dead``) get 0, not -inf: the kernel then sees finite rows, whose output and gradient are zeroed around it
    (a row of -inf only is log-sum-exp -inf, and ``exp(-inf - -inf)`` is NaN in a backward)."""
    if mask is None:
        return None
    m = mask[(None,) * (4 - mask.dim())]
    s = m.shape[-1]
    padded = -(-s // BIAS_ALIGN) * BIAS_ALIGN
    bias = torch.zeros(*m.shape[:-1], padded, dtype=dtype, device=m.device)[..., :s]
    if m.dtype == torch.bool:
        bias.masked_fill_(~m, -math.inf)
    else:
        bias.copy_(m)
    if dead is not None:
        bias.masked_fill_(dead, 0.0)
    return bias.expand(shape)


def _fused_forward(kind: str, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, dropout_p: float,
                   is_causal: bool, scale: float):
    """``(out, lse, aux, sizes)``: the kernel's output and log-sum-exp, and what its backward takes besides:
    ``aux = (cum_seq_q, cum_seq_k, philox_seed, philox_offset)`` (tensors, or None) and ``sizes = (max_q,
    max_k)``. ``k``, ``v`` have ``q``'s heads (grouped-query attention expanded by the caller)."""
    if kind == "flash":
        out, lse, cq, ck, mq, mk, seed, offset, _ = _op(kind, 0)(q, k, v, dropout_p, is_causal, False, scale=scale)
        return out, lse, (cq, ck, seed, offset), (mq, mk)
    out, lse, seed, offset = _op(kind, 0)(q, k, v, bias, True, dropout_p, is_causal, scale=scale)
    return out, lse, (None, None, seed, offset), (0, 0)


def _fused_backward(kind: str, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor,
                    lse: Tensor, aux, sizes, dropout_p: float, is_causal: bool, scale: float):
    cq, ck, seed, offset = aux
    if kind == "flash":
        return _op(kind, 1)(grad, q, k, v, out, lse, cq, ck, *sizes, dropout_p, is_causal, seed, offset, scale=scale)
    if not out.transpose(1, 2).is_contiguous():  # the layout the kernel returned it in, which its backward reads
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    gq, gk, gv, _ = _op(kind, 1)(grad, q, k, v, bias, out, lse, seed, offset, dropout_p, [True, True, True, False],
                                 is_causal, scale=scale)
    return gq, gk, gv


def _expand_heads(t: Tensor, rep: int) -> Tensor:
    """Grouped-query attention: ``[B, H_kv, S, D]`` as ``[B, H, S, D]`` for the kernels (transient)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _sum_heads(g: Tensor, rep: int) -> Tensor:
    """The gradient of :func:`_expand_heads`: summed over each group's ``rep`` heads."""
    if rep == 1:
        return g
    b, h, s, d = g.shape
    return g.reshape(b, h // rep, rep, s, d).sum(2)


class _FusedAttention(SlimFunction):
    """PyTorch's fused CUDA kernels forward and backward (kind ``"flash"`` or ``"efficient"``), with q, k, v kept
    packed (per head) and, under a lossless policy, the output, log-sum-exp and the kernel's Philox seed and
    offset exact; at 8 bits the backward recomputes the output and log-sum-exp from the restored q, k, v (one
    more fused forward), with dropout on the generator state the forward drew from (the same seed and offset:
    the same mask)."""

    layer = "attention (CUDA fused)"

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, dropout_p, kind, cfg_q, cfg_kv, state, dead, sinks=None,
                one_fill=None):
        # dead: the mask's fully masked rows [..., T, 1] where there are any (read by the caller with its other flags)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        exact = cfg_q is None  # lossless: keep the output, lse and seed/offset; 8-bit: recompute them
        rng = _rng_state(q.device) if dropout_p > 0 and not exact else None  # before the kernel draws
        bias = _aligned_bias(mask, q.dtype, dead, shape)
        out, lse, aux, sizes = _fused_forward(kind, q, _expand_heads(k, rep), _expand_heads(v, rep), bias,
                                              dropout_p, is_causal, scale)
        del bias
        out, lse = _sunk(out, lse, sinks, dead)
        if dead is not None:
            # In place: the kernel's layout ([B, T, H, D] memory) is kept, which the memory-efficient fp16/bf16
            # backward reads the kept output with (out of place, masked_fill made it contiguous: on an H200 the
            # q and k gradients of tempo's bf16 attention with a fully masked row were 80% off).
            out.masked_fill_(dead, 0)
        ctx.args = (kind, is_causal, scale, dropout_p, q.dtype, shape, sizes if exact else None)
        kept = (out, lse, *aux) if exact else (None,) * 6
        save(ctx, *_pack_qkv(ctx, q, k, v, cfg_q, cfg_kv, state), *kept, _saved_mask(mask, one_fill), dead, rng,
             sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cq, ck, seed, offset, mask, dead, rng, sinks = load(ctx)
        q, k, v = _loaded_qkv(ctx, q, k, v)
        kind, is_causal, scale, dropout_p, dtype, shape, sizes = ctx.args
        rep = q.shape[1] // k.shape[1]
        ke, ve = _expand_heads(k, rep), _expand_heads(v, rep)
        bias = _aligned_bias(mask, dtype, dead, shape)
        aux = (cq, ck, seed, offset)
        if out is None:  # the output and lse of the restored q, k, v, with the forward's dropout draws
            if rng is not None:
                _refuse_vmap_mode("attention")
            with _replaying(rng, q.device):
                out, lse, aux, sizes = _fused_forward(kind, q, ke, ve, bias, dropout_p, is_causal, scale)
            out, lse = _sunk(out, lse, sinks, dead)
        if dead is not None:
            grad_out = grad_out.masked_fill(dead, 0)
        gq, gk, gv = _fused_backward(kind, grad_out.contiguous(), q, ke, ve, bias, out, lse, aux, sizes, dropout_p,
                                     is_causal, scale)
        gs = _sinks_grad(grad_out, out, lse, sinks, dead) if sinks is not None and ctx.needs_input_grad[12] else None
        return (gq, _sum_heads(gk, rep), _sum_heads(gv, rep), None, None, None, None, None, None, None, None, None,
                gs, None)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    cfg: QuantConfig | None = None,
    state: dict[str, RunningRange] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` keeping no ``[T, S]`` tensor.

    Keeps ``query``, ``key``, ``value`` packed with ``cfg`` (a per-head config, ``group_dim=1``), recomputing the
    output and log-sum-exp in the backward; with ``cfg=None`` keeps them and the output and log-sum-exp exactly.
    A boolean ``attn_mask`` is kept as bits; a float mask that requires grad (a learned bias) gets its gradient.
    On CUDA it runs PyTorch's fused kernels (flash or memory-efficient, :func:`fused_kernel`), forward and
    backward, with dropout drawn by the kernel (Philox) and replayed from the generator state or the kernel's
    seed and offset; on CPU without dropout PyTorch's CPU flash kernel (forward and backward, on the restored
    tensors); otherwise a flash-style path in PyTorch ops, chunked over query rows in the backward, whose
    dropout mask is drawn by ``native_dropout`` (the draws of eager ``F.dropout``), only the generator state
    kept, and redrawn in the backward. Grouped-query attention (fewer key/value heads, ``enable_gqa=True``)
    keeps ``key``/``value`` unrepeated. See the module docstring for what is kept and its bytes.

    Args: those of ``F.scaled_dot_product_attention``; ``cfg`` the compression; ``state`` running
    estimates (``{"q", "k", "v", "o"}``) for ``scale="running"``; ``sinks`` ``[H]``: attention sinks (gpt-oss's),
    one learned logit per query head that joins every row's softmax and meets no value,
    ``softmax([s, sink])[..., :S] @ v``, differentiated too (nothing more is kept: the kernels' output and
    log-sum-exp are rescaled, :func:`_sunk`; the chunked path adds it to each row's sum).
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("slimact's scaled_dot_product_attention takes [B, H, T, D] query, key and value")
    # One key/value head broadcasts over the query heads (Falcon's multi-query) as in PyTorch, without enable_gqa;
    # other counts need it. enable_gqa stays as given: PyTorch's kernel choice differs (its CPU math kernel for the
    # broadcast, flash with enable_gqa), and _math_chosen follows the call's own.
    # One query head broadcasts over the key/value heads in PyTorch (without enable_gqa): PyTorch's own call below.
    one_query_head = query.shape[1] == 1 and not enable_gqa
    if key.shape[1] not in (query.shape[1], 1) and not (enable_gqa and query.shape[1] % key.shape[1] == 0) \
            and not one_query_head:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for grouped-query attention"
        )
    if attn_mask is not None and is_causal:
        raise ValueError("pass either attn_mask or is_causal, not both (as F.scaled_dot_product_attention)")
    _check_sinks(sinks, query.shape[1])
    # Nothing to keep, and the paths below divide by the empty size: PyTorch's CPU flash kernel with no query or no key
    # row, or no head, died of SIGFPE (the whole process), the chunked path raised. A mask neither boolean nor
    # floating (uint8, int64), which PyTorch refuses, was added as if additive (a 0/1 "keep" mask: +1 on the kept
    # scores). PyTorch's own call for both.
    empty = query.numel() == 0 or key.numel() == 0 or value.numel() == 0
    # Key and value broadcast each on its own in PyTorch (one key head, H value heads): slimact's paths take them
    # as one head count (the backward failed reshaping the key's gradient), as PyTorch's own call (as the routed call);
    # so one query head broadcast over H key/value heads (it raised "pass enable_gqa=True").
    apart = key.shape[:2] != value.shape[:2] or (one_query_head and key.shape[1] > 1)
    if empty or apart or (attn_mask is not None and attn_mask.dtype != torch.bool
                          and not attn_mask.is_floating_point()):
        return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks))
    mask_grad = torch.is_grad_enabled() and attn_mask is not None and attn_mask.requires_grad
    # Under torch.compile, attention with dropout is PyTorch's own: the mask replay reads the host RNG state,
    # which dynamo cannot trace (a graph break), and inductor draws dropout from its own generator anyway.
    # Dropout of every probability (p = 1) is PyTorch's own call too: it draws nothing there (zeros), where a mask
    # drawn here advanced the generator, and every later dropout of the step dropped other elements than plain's.
    if (not needs_grad and not mask_grad) or (dropout_p > 0 and torch.compiler.is_compiling()) or dropout_p >= 1.0:
        return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks)
    device = query.device.type
    if torch.is_autocast_enabled(device):
        # What autocast does for F.scaled_dot_product_attention (a lower-precision op): run it on q, k, v (and a
        # float mask) cast to the autocast dtype. The kernels below are not autocast ops, so cast here, once.
        low = torch.get_autocast_dtype(device)
        query, key, value = (x.to(low) if x.is_floating_point() else x for x in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
        with torch.autocast(device, enabled=False):
            return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                                cfg=cfg, state=state, sinks=sinks)
    # Attention that would amplify 8-bit q/k errors on its scores keeps q, k, v exact (functional.attention_guard);
    # a NaN/inf in q or k keeps the fused kernels out (fused_kernel). The two flags read in one host sync (each
    # drains a CUDA stream).
    kind = _fused_kind(query, key, value, attn_mask, dropout_p, is_causal, mask_grad)
    # PyTorch's CPU flash kernel drops NaN from its output where a row's scores are all NaN (a NaN in the query,
    # or in the key of a one-key row: F.scaled_dot_product_attention's too, torch 2.13): a query or key holding
    # NaN/inf takes the chunked path, whose output is NaN there, as the math path's.
    # (fp16 too: PyTorch's CPU call runs that kernel for fp16 as well; the chunked path's output was an fp16 ulp
    # or two from it, 2.4e-4-9.8e-4, and a tiny Llama's fp16 logits under "tempo" 2.4e-4 from plain's)
    flash = (dropout_p == 0.0 and device == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
             and not mask_grad)
    # The kernel takes one head width for q, k and v (F.scaled_dot_product_attention picks its math kernel where
    # the value heads are of another width, GLM-5 Next's): the chunked path.
    flash = flash and query.shape[-1] == key.shape[-1] == value.shape[-1]
    flags = {}
    error = checked_score_error(query, key, scale, cfg)
    if error is not None:
        flags["unsafe"] = error > MAX_SCORE_ERROR
    dead = None
    if (kind is not None or flash) and not torch.compiler.is_compiling():
        # A NaN/inf in q or k makes the guard's error non-finite (its norms), where it has one: no pass of its own
        # (on the CPU it was two isfinite passes and their all(), 1.3 ms a Llama layer at 4 x 256).
        flags["not_finite"] = _not_finite(query, key) if error is None else (error - error) != 0
        if attn_mask is not None:  # whether the mask has fully masked rows: in the same read (was one of its own)
            dead = _dead(attn_mask)
            flags["dead"] = dead.any()
            if attn_mask.is_floating_point():  # rows masked with a finite fill only: the chunked path (SWAMPED_FILL)
                flags["swamped"] = _swamped(attn_mask)
                if not attn_mask.requires_grad and _kept_mask(attn_mask)[1] is None:  # (for _saved_mask)
                    own = _own(attn_mask)
                    flags["one_fill"] = _one_fill(own, _fill(own))
    elif kind is not None:
        dead = _dead_rows(attn_mask)  # (compiling: no read; the rows are masked whether or not any is dead)
    if flags:
        values = list(flags.values())
        both = values[0].reshape(1) if len(values) == 1 else torch.stack(values)  # (a lone flag: a view, no launch)
        read = dict(zip(flags, both.tolist(), strict=True))
        cfg = None if read.get("unsafe") else cfg
        if read.get("unsafe"):
            note_trip()
        kind = None if read.get("not_finite") or read.get("swamped") else kind
        flash = flash and not read.get("not_finite") and not read.get("swamped")
        dead = dead if read.get("dead", True) else None
    one_fill = read.get("one_fill") if flags else None
    if value is key and torch.compiler.is_compiling():
        # (DeepSeek V4's keys are its values: dynamo traces no autograd Function handed one tensor twice, a graph
        # break at every layer. A view of it is another tensor; eager keeps one pack of the two, compiled two.)
        value = key.view(key.shape)
    if kind is not None:
        return _FusedAttention.apply(query, key, value, attn_mask, is_causal, scale, dropout_p, kind, cfg, cfg, state,
                                     dead, sinks, one_fill)
    math_forward = _math_chosen(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if flash and not math_forward:
        return _FlashAttentionCPU.apply(query, key, value, attn_mask, is_causal, scale, cfg, cfg, state, sinks,
                                        one_fill)
    # (with sinks PyTorch has no kernel of its own to match: the chunked path's rows, which add the sink)
    return _ChunkedAttention.apply(query, key, value, attn_mask, is_causal, scale, dropout_p, cfg, cfg, state,
                                   math_forward and sinks is None, sinks, one_fill)


def _attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
               is_causal: bool, scale: float | None, enable_gqa: bool, sinks: Tensor | None) -> Tensor:
    """PyTorch's own attention, for the calls slimact leaves as written: ``F.scaled_dot_product_attention``, or with
    ``sinks`` (which it does not take) its math in PyTorch ops, the scores in fp32 (fp64 for fp64 inputs), as the
    eager attention of the models that have sinks computes it (``softmax(cat([s, sink]))[..., :-1] @ v``)."""
    if sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    h, h_kv = query.shape[-3], key.shape[-3]
    if enable_gqa and h_kv not in (1, h):
        key, value = (x.repeat_interleave(h // h_kv, dim=-3) for x in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(query.to(work), key.to(work).transpose(-1, -2)) * scale  # [B, H, T, S]
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -math.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.to(work)
    sink = sinks.to(work).view(-1, 1, 1).expand(*s.shape[:-1], 1)
    probs = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return torch.matmul(probs, value.to(work)).to(query.dtype)
