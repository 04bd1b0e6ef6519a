"""Scale groups by blocks of a head's channels, for 8-bit packs of ``[B, H, T, D]`` attention operands.

A per-head config (``group_dim=1``, ``groups=0``) gives every head one scale. That cannot resolve a head whose
channels are of different sizes, and heads concatenate parts of different origins: Conditional DETR's and DAB-DETR's
content and position halves (``[q_content, q_sine]``, 100x apart in a tiny Conditional DETR's second decoder layer),
MLA's ``[q_nope, q_pe]`` and ``[k_nope, k_pe]``. The small part then gets a few codes of the large part's step, and
what its channels carry to the other operand's gradient (``grad_k = grad_s^T q`` keeps q's channels apart) is noise:
the tiny Conditional DETR's ``k_pos_proj`` weight gradient at cosine 0.81 with a scale per head, 0.9999 with one per
:data:`HEAD_BLOCK` channels of a head. Such a pack views ``x`` as ``[B, T, H * D]`` with channel groups of 16: 8 bytes
of scale a block, ``D / 16`` per head instead of one. ``x`` is most often ``[B, T, H, D]`` memory (a projection's
output viewed as heads), which the view reads as it lies; a ``[B, H, T, D]``-contiguous ``x`` is copied for the pack
(transient). Callers block only the operands whose channels a product contracts with another tensor's alone
(``q`` and ``k``; not ``v``, whose channels are summed over together). Running estimates (Mesa's scheme,
``"mesa"``) stay per head, as published.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from slimact.quant import QuantConfig

#: Channels of a head with a scale group of their own (:func:`head_blocks`).
HEAD_BLOCK = 16


def head_blocks(x: Tensor, cfg: QuantConfig | None) -> tuple[Tensor, QuantConfig | None]:
    """``x`` ``[B, H, T, D]`` seen as ``[B, T, H * D]`` with one scale group per :data:`HEAD_BLOCK` channels of each
    head (module docstring), where ``cfg`` is per head with the tensor's own range and ``D`` is a multiple of 16
    above 16; else ``x`` and ``cfg`` as given (:func:`from_head_blocks` undoes the view)."""
    if cfg is None or cfg.group_dim not in (1, -3) or cfg.groups != 0 or cfg.scale != "dynamic" or x.dim() != 4:
        return x, cfg
    b, h, t, d = x.shape
    if d % HEAD_BLOCK or d == HEAD_BLOCK:
        return x, cfg
    return x.transpose(1, 2).reshape(b, t, h * d), dataclasses.replace(cfg, group_dim=-1, groups=h * d // HEAD_BLOCK)


def from_head_blocks(x: Tensor, heads: int) -> Tensor:
    """A restored pack of :func:`head_blocks`, ``[B, T, H * D]``, seen as ``[B, H, T, D]`` again (a view); a
    ``[B, H, T, D]`` one (not blocked) as it is."""
    return x if x.dim() == 4 else x.unflatten(-1, (heads, -1)).transpose(1, 2)
