"""``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``/``DecoderLayer``) through slimact.

The converted module computes the input projection with slimact's Linear (its input kept 8-bit, shared by
q, k and v in self-attention), attention with :func:`slimact.functional.scaled_dot_product_attention` (q, k,
v and the output kept 8-bit per head, or exact under a lossless policy; never a ``[T, S]`` tensor), and the
output projection with slimact's Linear. Masks follow ``nn.MultiheadAttention``: a boolean ``attn_mask`` or
``key_padding_mask`` marks positions *not* to attend; float masks are added. Calls this path does not cover
(``need_weights=True``, separate key/value projection weights, ``bias_k``/``bias_v``, ``add_zero_attn``, unbatched
``[T, E]`` inputs, integer masks, ``is_causal`` without ``attn_mask``) run the module's own forward; ``summary`` with
inputs reports a module each of whose calls did (``need_weights=True`` is the module's default).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimact.functional.attention import _additive, scaled_dot_product_attention
from slimact.functional.attention_guard import GUARDED_ATTR, guarded
from slimact.functional.linear import linear
from slimact.nn._base import SlimModule, slim_class

__all__ = ["OWN_FORWARD_ATTR", "SLIM_FORWARD_ATTR", "mha_class"]


def _additive_from_mha(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """An ``nn.MultiheadAttention`` mask (boolean ``True`` = do *not* attend, the opposite of SDPA's) as an additive
    one, -inf where masked, so a fully masked row is recognised as such (and gives 0, not NaN)."""
    return _additive(~mask if mask is not None and mask.dtype == torch.bool else mask, dtype)


#: Set on a converted ``nn.MultiheadAttention`` by its training calls: why one ran the module's own forward (a call
#: this path does not cover), and that one ran this path. ``summary`` with inputs reports a module whose calls all
#: ran its own forward as left alone (``need_weights=True``, the module's default, is such a call).
OWN_FORWARD_ATTR = "_slimact_own_forward"
SLIM_FORWARD_ATTR = "_slimact_slim_forward"


class _MultiheadAttentionMixin(SlimModule):
    def _slimact_uncovered(self, query, key, value, need_weights, attn_mask, key_padding_mask, is_causal) -> str | None:
        """Why this path does not cover a call (``None``: it does)."""
        if need_weights:
            return "need_weights=True, the module's default (pass need_weights=False where the weights are not used)"
        if not self._qkv_same_embed_dim or self.bias_k is not None or self.bias_v is not None or self.add_zero_attn:
            return "kdim/vdim, add_bias_kv or add_zero_attn"
        if key.shape != value.shape or query.dim() != 3 or key.dim() != 3:
            return "unbatched inputs, or keys and values of other shapes"
        # A mask neither boolean nor floating (uint8, int64): the module's own forward refuses it (here it was added
        # as if additive: a uint8 key_padding_mask, boolean before PyTorch 2.0, padded nothing).
        if any(m is not None and m.dtype != torch.bool and not m.is_floating_point()
               for m in (attn_mask, key_padding_mask)):
            return "a mask neither boolean nor floating"
        # A floating mask neither float32 nor of the query's dtype, which PyTorch's attention refuses (float64 with
        # fp32 queries: here it was cast and trained): its own forward, and its error. (An fp32 mask with bf16
        # queries, a bf16 model's or autocast's, PyTorch takes: this path too.)
        if any(m is not None and m.is_floating_point() and m.dtype not in (torch.float32, query.dtype)
               for m in (attn_mask, key_padding_mask)):
            return "a floating mask neither float32 nor of the query's dtype"
        if is_causal and attn_mask is None:  # (the module's own forward raises "Need attn_mask ...")
            return "is_causal without attn_mask"
        return None

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        active = self._slimact_active(query, key, value)
        # (only for a call this path could take: TransformerEncoder's eval fast path passes nested tensors, which
        # have no .shape to compare)
        why = (self._slimact_uncovered(query, key, value, need_weights, attn_mask, key_padding_mask, is_causal)
               if active else None)
        if not torch.compiler.is_compiling() and active and torch.is_grad_enabled():
            self.__dict__[OWN_FORWARD_ATTR if why else SLIM_FORWARD_ATTR] = why or True
        if not active or why is not None:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        self._slimact_begin()
        # Which inputs are one tensor, read before the transposes below make a view of each: F.multi_head_attention_
        # forward projects one input once (self-attention: q, k and v; encoder-decoder attention: k and v), and so
        # does this path. (Read after them, a time-major self-attention projected its input three times: the same
        # output, but in bf16 an input gradient summed from three products, 1 ulp off plain's, 6e-3 relative.)
        self_attention, shared_kv = query is key and key is value, key is value
        # Projected time-major as F.multi_head_attention_forward projects them: a batch-first input through its
        # transposed view (no copy: a kept input serves the projection as it is). The same layout, the same ATen
        # path: F.linear of a [B, T, E] input and of its [T, B, E] view round apart where the weight is frozen
        # (BitFit) and at some widths (512) even where it trains: outputs 1 ulp off plain's, in no_grad too.
        if self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        (t, b, e), s, h = query.shape, key.shape[0], self.num_heads  # [T, B, E], S keys
        cfg = self._slimact_cfg(query)
        state = self._slimact_state  # running estimates per operand (scale="running"), else None
        if self_attention:  # one projection, one kept input
            q, k, v = linear(query, self.in_proj_weight, self.in_proj_bias, cfg, state("x")).chunk(3, dim=-1)
        elif shared_kv:  # keys and values from one input: one projection for both
            w_q, w_kv = self.in_proj_weight.split([e, 2 * e])
            b_q, b_kv = (None, None) if self.in_proj_bias is None else self.in_proj_bias.split([e, 2 * e])
            q = linear(query, w_q, b_q, cfg, state("x0"))
            k, v = linear(key, w_kv, b_kv, cfg, state("x1")).chunk(2, dim=-1)
        else:
            w, bias = self.in_proj_weight.chunk(3), (self.in_proj_bias.chunk(3) if self.in_proj_bias is not None
                                                      else (None, None, None))
            q, k, v = (linear(x, w_i, b_i, cfg, state(f"x{i}"))
                       for i, (x, w_i, b_i) in enumerate(zip((query, key, value), w, bias, strict=True)))
        q, k, v = (x.reshape(*x.shape[:2], h, e // h).permute(1, 2, 0, 3) for x in (q, k, v))  # [B, H, T|S, D]
        # As F.multi_head_attention_forward: without a key padding mask (and weights, never asked for here) the
        # is_causal hint stands for attn_mask, which is not read (a mask that is not causal, a wrong hint, gave
        # another output than plain's: 0.96 apart); with one, the masks are merged and the hint is dropped.
        causal = bool(is_causal and key_padding_mask is None)
        attn_mask = None if causal else attn_mask
        mask = _additive_from_mha(attn_mask, q.dtype)
        if mask is not None:
            mask = mask.view(1, 1, t, s) if mask.dim() == 2 else mask.view(b, h, t, s)
        if key_padding_mask is not None:
            pad = _additive_from_mha(key_padding_mask, q.dtype).view(b, 1, 1, s)
            mask = pad if mask is None else mask + pad
        out, tripped = guarded(
            scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            cfg=self._slimact_policy.quant_config("attention", 4),
            state=None if state() is None else {n: state(n) for n in ("q", "k", "v", "o")},
        )
        if tripped:  # (q, k, v kept exact for the score error guard: summary(model, inputs) says so)
            self.__dict__[GUARDED_ATTR] = True
        out = out.permute(2, 0, 1, 3).flatten(0, 1).flatten(1)  # [T * B, E]
        out = linear(out, self.out_proj.weight, self.out_proj.bias, self._slimact_cfg(out), state("out"))
        # Laid out time-major, as nn.MultiheadAttention lays its output out (a later dropout draws its mask in memory
        # order: the same layout gives the plain module's masks).
        out = out.view(t, b, e)
        return (out.transpose(0, 1) if self.batch_first else out), None


def mha_class(cls: type[nn.Module]) -> type[nn.Module]:
    return slim_class(_MultiheadAttentionMixin, cls)
