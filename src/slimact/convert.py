"""``convert`` / ``revert`` / ``summary``: one call turns a model's layers into slimact's, reversibly.

Conversion swaps the class of each chosen module for its slimact subclass, in place (see
:mod:`slimact.nn._base`): no parameter is copied or re-initialised, ``state_dict`` keys and values are
unchanged, ``isinstance`` checks keep working, and ``revert`` restores the original classes.
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import math
import os
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from slimact import attention
from slimact._kinds import (
    Recognised,
    _cls,
    foreign_linear_weight,
    forget,
    forward_names,
    kind_of,
    probed_state,
    recognise,
    recognising,
    scores_in_code,
    uses_attention_interface,
    written_in_model_code,
)
from slimact.functional._saving import is_dtensor
from slimact.functional.attention_guard import GUARDED_ATTR, MAX_SCORE_ERROR
from slimact.nn._base import (
    TRANSFORMED_ATTR,
    SlimModule,
    StepCounter,
    as_written,
    attach,
    clear_state,
    detach,
    refuse_script,
)
from slimact.nn.activation import activation_class
from slimact.nn.attention import OWN_FORWARD_ATTR, SLIM_FORWARD_ATTR, mha_class
from slimact.nn.batch_norm import batch_norm_class
from slimact.nn.clamped_glu import GATE_ATTR, Gate, gate_form
from slimact.nn.conv import conv_class
from slimact.nn.dropout import dropout_class
from slimact.nn.linear import conv1d_class, linear_class, pyg_linear_class
from slimact.nn.matmul import MatMul
from slimact.nn.mlp import gated_mlp_class
from slimact.nn.norm import group_norm_class, norm_class
from slimact.nn.routing import FUNCTIONAL_NAME, Routing, _routing_of, drop_routing_hooks, routings_around
from slimact.nn.softmax import softmax_class
from slimact.policy import Policy, matches, resolve

__all__ = ["Summary", "convert", "revert", "summary"]

FilterFn = Callable[[nn.Module, str], bool]

# Attributes of the converted model itself (named so that detaching the root module leaves them alone).
_POLICY_ATTR = "_slimact_root_policy"
_SKIPPED_ATTR = "_slimact_root_skipped"
_HOOK_ATTR = "_slimact_root_hook"
_ROUTE_ATTR = "_slimact_root_routing"
_ATTN_ATTR = "_slimact_root_attn"


#: The slimact class for each replacement the recogniser names (:func:`slimact._kinds.recognise`).
_FACTORIES: dict[str, Callable[[type[nn.Module]], type[nn.Module]]] = {
    "mlp": gated_mlp_class,
    "mha": mha_class,
    "conv1d": conv1d_class,
    "pyg_linear": pyg_linear_class,
    "linear": linear_class,
    "conv": conv_class,
    "batchnorm": batch_norm_class,
    "norm": norm_class,
    "groupnorm": group_norm_class,
    "softmax": softmax_class,
    "matmul": lambda cls: MatMul,
    "dropout": dropout_class,
    "activation": activation_class,
}


_COMPUTED_BY_PARENT = "computed by its parent (a fused gated MLP or attention module)"
#: How summary names a routed kind whose name says more than what is routed.
_ROUTED_AS = {"linear": "linear (torch._grouped_mm only)", "product": "product (of an activation's output)"}


def _replacement(module: nn.Module) -> tuple[type[nn.Module] | None, str | None, Recognised]:
    """``(slimact class, None, found)`` for a convertible module, ``(None, reason, found)`` for a known kind
    slimact leaves alone, ``(None, None, found)`` for anything else."""
    found = recognise(module)
    if found.replace is None:
        return None, found.reason, found
    return _FACTORIES[found.replace](_cls(module)), None, found


def _leave_alone(pol: Policy, kind: str, name: str, module: nn.Module, filter_fn: FilterFn | None,
                 index: int = -1) -> str | None:
    """Why ``module`` stays as it is (the policy, then ``filter_fn``), or ``None`` to convert it."""
    reason = pol.skip_reason(kind, name, index)
    if reason is None and filter_fn is not None and not filter_fn(module, name):
        reason = "excluded by filter_fn"
    return reason


#: The rules below read the data flow from the order a block registers its modules (not traced before a forward;
#: ultralytics' attention registers ``qkv, proj, pe`` and applies ``pe`` to ``v``): a false match costs memory alone.
_BY_ORDER = "as the order of registration tells (the data flow is not traced): "
_REMAINDER = ("removes any per-channel scale: its weight's exact gradient is the small remainder BatchNorm's eps "
              "leaves, swamped by the 8-bit error of either layer's kept tensor")
_SCALE_FREE = _BY_ORDER + (
    "its output reaches a training-mode BatchNorm through a per-channel (depthwise) conv in the same block, which "
    f"{_REMAINDER} (CvT: cosine 0.79-0.92); kept exact, as PyTorch does"
)
_SCALE_FREE_LAST = _BY_ORDER + (
    "it is the last layer registered before a per-channel (depthwise) conv into a training-mode BatchNorm (a "
    "post-norm Transformer layer's final norm before a convolution block), which "
    f"{_REMAINDER} (cosine 0.11-0.93); kept exact, as PyTorch does"
)


_NORM_INTO_BN = _BY_ORDER + (
    "its output reaches a training-mode BatchNorm over the same channels directly (ReLU-like activations and "
    f"dropouts between, if any), which {_REMAINDER} (a LayerNorm before a ghost BatchNorm as TabNet's: cosine "
    "0.25-0.44, 17-62x the exact norm); kept exact, as PyTorch does"
)
_BN_INTO_CHANNEL_NORM = _BY_ORDER + (
    "its output reaches a norm standardising each of its channels on its own (an InstanceNorm, a GroupNorm of one "
    f"channel a group) directly (ReLU-like activations and dropouts between, if any), which {_REMAINDER} (cosine "
    "0.31 and -0.07 under \"int8\" and \"mesa\", 1000x the exact norm; a sweep); kept exact, as PyTorch does"
)
_REMOVES_NORM_SCALE = _BY_ORDER + ("it removes the per-channel scale of the norm registered right before it (see that "
                                   "norm): its input is kept exact")
_SCALE_FREE_BN = _BY_ORDER + (
    "its output reaches a training-mode BatchNorm through a per-channel (depthwise) conv (and ReLU-like "
    "activations, if any, before it), which remove nothing of a per-channel scale that the BatchNorm then removes: "
    "its weight's exact gradient is a nearly cancelling sum, swamped by the 8-bit error of either BatchNorm's kept "
    "input (MobileNetV2, MNASNet, ShuffleNetV2: cosine -0.2-0.7 at initialisation and after 30 steps); kept exact, "
    "as PyTorch does"
)
_REMOVES_SCALE = _BY_ORDER + ("it removes the per-channel scale of a norm's output that reaches it through a "
                              "depthwise conv (see that norm): its input is kept exact")
_ONE_WEIGHT_A_CHANNEL = _BY_ORDER + (
    "each of its output channels is one weight times one input channel (a 1x1 kernel over one input channel a "
    "group), and the norm registered after it standardises each of those channels: the weight's exact gradient is "
    "the small remainder the norm's eps leaves, swamped by the 8-bit error of its kept input (MONAI's UNETR and "
    "SwinUNETR, a 1x1 conv on the one-channel image before an InstanceNorm: cosine 0.27 and 0.22); kept exact, as "
    "PyTorch does"
)
_REMOVES_WEIGHT = _BY_ORDER + ("it standardises each output channel of the conv registered before it, whose weight "
                               "is one scale a channel (see that conv): its input is kept exact")
#: Activations that pass a positive per-channel scale through (``f(a x) = a f(x)``; ReLU6 up to its rarely
#: reached cap), and layers that do not change values in a training step's sense of scale.
_SCALE_PASSING = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.Identity, nn.Dropout)


def _depthwise_into_batch_norm(a: nn.Module, b: nn.Module) -> bool:
    return (isinstance(a, nn.modules.conv._ConvNd) and isinstance(b, nn.modules.batchnorm._BatchNorm)
            and a.groups == a.in_channels == a.out_channels == b.num_features)


def _standardises_each_channel(m: nn.Module) -> bool:
    """Whether ``m`` standardises each channel on its own: an InstanceNorm, a GroupNorm of one channel a group."""
    return (isinstance(m, nn.modules.instancenorm._InstanceNorm)
            or (isinstance(m, nn.GroupNorm) and m.num_groups == m.num_channels))


def _channels_of(m: nn.Module) -> int:
    return m.num_features if isinstance(m, nn.modules.instancenorm._InstanceNorm) else m.num_channels


def _one_weight_into_channel_norm(a: nn.Module, b: nn.Module) -> bool:
    """``a`` a conv whose every output channel is one weight times one input channel, ``b`` a norm standardising each
    of those channels on its own (BatchNorm, InstanceNorm, GroupNorm of one channel a group)."""
    # (in_channels / groups inputs a channel, each through the whole kernel: a transposed conv's weight is laid out
    # [in, out / groups, *kernel], so its weight[0] is not one channel's)
    if not isinstance(a, nn.modules.conv._ConvNd) or a.in_channels // a.groups * math.prod(a.kernel_size) != 1:
        return False
    if isinstance(b, nn.modules.batchnorm._BatchNorm):
        return b.num_features == a.out_channels
    return _standardises_each_channel(b) and _channels_of(b) == a.out_channels


def _before_scale_passing(leaves: list[tuple[str, nn.Module]], i: int) -> int:
    """The index of the last of ``leaves`` registered before the ``i``-th that is not a :data:`_SCALE_PASSING` layer
    (0 at the least)."""
    j = i - 1
    while j > 0 and isinstance(leaves[j][1], _SCALE_PASSING):
        j -= 1
    return j


def _scale_free_chains(model: nn.Module) -> dict[str, str]:
    """Convs whose weight is one scale a channel registered right before a norm standardising each channel (which
    removes that scale), and that norm; norms whose per-channel scale a BatchNorm downstream removes, and those
    BatchNorms: a depthwise conv (``groups == in == out channels``) registered right before a BatchNorm over the same
    channels, and LayerNorms/RMSNorms/GroupNorms of that width held by an enclosing block (a direct child of one of
    the pair's ancestors), or a BatchNorm of that width registered right before the conv, ReLU-like activations and
    dropouts between (a MobileNetV2 block's expansion: BatchNorm, ReLU6, depthwise conv, BatchNorm), or, where the
    pair's block holds no such norm, the LayerNorm/RMSNorm/GroupNorm of that width registered last before the conv,
    layers without parameters between (a post-norm ``nn.TransformerEncoderLayer`` before it: its norm2, then its
    dropouts). Found from the module tree at convert time (the data flow is not known before a forward); a false
    match only costs memory (those layers keep what PyTorch keeps). ``{name: reason}``."""
    out: dict[str, str] = {}
    leaves = [(name, m) for name, m in model.named_modules() if not m._modules]
    for (name, conv), (norm_name, norm) in itertools.pairwise(leaves):
        if _one_weight_into_channel_norm(conv, norm):
            out[name], out[norm_name] = _ONE_WEIGHT_A_CHANNEL, _REMOVES_WEIGHT
    for i, (bn_name, bn) in enumerate(leaves[1:], 1):
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            continue
        j = _before_scale_passing(leaves, i)
        # (a LayerNorm, RMSNorm or GroupNorm: a BatchNorm registered right before a BatchNorm is RepVGG's parallel
        # branches, rbr_1x1's then rbr_identity's, more often than a chain; TextNet would keep 20 of them exact)
        norm_name, norm = leaves[j]
        if _gain_width(norm, {bn.num_features}) is not None:
            out.setdefault(norm_name, _NORM_INTO_BN)
            out.setdefault(bn_name, _REMOVES_NORM_SCALE)
    for i, (norm_name, norm) in enumerate(leaves[1:], 1):
        if not _standardises_each_channel(norm):
            continue
        bn_name, bn = leaves[_before_scale_passing(leaves, i)]
        # (children of one nn.Sequential, whose data flows from one to the next: in IBN-Net's IBN-b block a residual
        # is added between its last BatchNorm and the InstanceNorm registered after it, and nothing cancels; a review)
        parent = bn_name.rpartition(".")[0]
        if (isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.num_features == _channels_of(norm)
                and norm_name.rpartition(".")[0] == parent and isinstance(model.get_submodule(parent), nn.Sequential)):
            out.setdefault(bn_name, _BN_INTO_CHANNEL_NORM)
            out.setdefault(norm_name, _REMOVES_NORM_SCALE)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    pairs: list[tuple[str, str, int]] = []  # (parent, batch norm name, channels)
    for pname, _, (_, a), (bname, b) in _adjacent_children(model):
        if _depthwise_into_batch_norm(a, b):
            pairs.append((pname, bname, b.num_features))
    if not pairs:
        return out
    last_norms: dict[str, str] = {}  # {batch norm: the norm registered last before its conv, of another block}
    for i, (_, conv) in enumerate(leaves[1:-1], 1):
        if not _depthwise_into_batch_norm(conv, leaves[i + 1][1]):
            continue
        j = _before_scale_passing(leaves, i)
        first, norm = leaves[j]
        if isinstance(norm, nn.modules.batchnorm._BatchNorm) and norm.num_features == conv.in_channels:
            out[first] = _SCALE_FREE_BN
            out[leaves[i + 1][0]] = _REMOVES_SCALE
            continue
        # The last norm registered before the conv, past any layer without parameters (the dropouts, an activation
        # module nn.TransformerEncoderLayer registers after its norms, a transpose): a block before the pair's.
        while j > 0 and not any(True for _ in leaves[j][1].parameters(recurse=False)):
            j -= 1
        first, norm = leaves[j]
        if _gain_width(norm, {conv.in_channels}) is not None:
            last_norms[leaves[i + 1][0]] = first
    widths = {c for _, _, c in pairs}
    for name, module in model.named_modules():
        width = _gain_width(module, widths)
        if width is None:
            continue
        holder = _block_of(model, name)
        # In the norm's block; a norm the model itself holds, registered before the pair (a final norm after the
        # blocks, XCiT's, feeds none of them). Inside a block registration may run against the data flow:
        # transformers' CvtLayer registers its attention (the pair) before the norm its forward applies first.
        hits = [bn for parent, bn, c in pairs if c == width and (
            (parent + ".").startswith(holder + ".") if holder else order[bn] > order[name])]
        if hits:
            out[name] = _SCALE_FREE
            out.update(dict.fromkeys(hits, _REMOVES_SCALE))
    # A pair whose own block holds no such norm reads the norm a block before it registered last: a post-norm
    # nn.TransformerEncoderLayer's norm2, then its dropouts. (A block holding one, transformers' CvtLayer, reads its
    # own: the previous layer's last norm, layernorm_after, feeds that layer's MLP.)
    for bn, norm_name in last_norms.items():
        if bn not in out:
            out.setdefault(norm_name, _SCALE_FREE_LAST)
            out[bn] = _REMOVES_SCALE
    return out


#: Layers whose backward needs their input: PyTorch's keep it in full.
_KEEPING_INPUT = (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)


def _relus_into_layers_as_written(model: nn.Module, pol: Policy) -> dict[str, str]:
    """``{name: reason}`` of each ``nn.ReLU`` whose next layer in its ``nn.Sequential`` (where the order of
    registration is the data flow; a child's last registered module before the next child's first) is a Linear, conv
    or BatchNorm keeping its input exact: that layer keeps the ReLU's output in full, as PyTorch's ReLU does, so a
    1-bit mask of it would be a second copy (under ``"tempo"``, torchaudio's Wav2Letter kept 1.029x plain's bytes).
    A wrong guess of the order costs memory only: either way the ReLU computes what PyTorch's does."""
    out: dict[str, str] = {}
    if "relu" not in pol.kinds:
        return out
    for _, parent, (aname, a), (bname, b) in _adjacent_children(model):
        if not isinstance(parent, nn.Sequential):
            continue
        # (or the last module registered in one child and the first in the next: transformers' ResNetConvLayer is
        # conv, norm, ReLU, applied in that order, and the next one's conv kept the ReLU's output in full beside
        # its mask: "tempo" kept 1.007x plain's bytes on ResNet, 1.011x on RegNet, a sweep)
        (aname, a), (bname, b) = _edge(aname, a, last=True), _edge(bname, b, last=False)
        if type(a) is not nn.ReLU or not isinstance(b, _KEEPING_INPUT):
            continue
        kind = kind_of(b)
        # (or a Linear or conv subclass convert leaves as written, its own forward, with a weight to train: zuko's
        # MaskedLinear in MAF and NSF, whose F.linear keeps its input whole; the converted ReLU's mask made the model
        # keep 1.02x plain's bytes. A frozen one keeps nothing of its input: there the mask is the ReLU's all.)
        if (pol.skip_reason(kind, bname) is not None or not pol.settings(kind).quantize
                or (isinstance(b, (nn.Linear, nn.modules.conv._ConvNd)) and _replacement(b)[0] is None
                    and isinstance(weight := getattr(b, "weight", None), Tensor) and weight.requires_grad)):
            out[aname] = (f"the next layer of its Sequential, a {type(b).__name__} keeping its input exact under this "
                          "policy, keeps its output in full, as PyTorch's ReLU does: a 1-bit mask of it would be a "
                          "second copy")
    return out


def _edge(name: str, module: nn.Module, last: bool) -> tuple[str, nn.Module]:
    """The module registered last (``last``) or first in ``module``, down to a leaf, with its qualified name."""
    while (kids := list(module.named_children())):
        child, module = kids[-1 if last else 0]
        name = f"{name}.{child}"
    return name, module


def _adjacent_children(model: nn.Module) -> Iterator[tuple[str, nn.Module, tuple[str, nn.Module],
                                                            tuple[str, nn.Module]]]:
    """``(parent name, parent, (name, child), (name, next child))`` of each pair of children registered one after
    the other, the children by their qualified names."""
    for pname, parent in model.named_modules():
        kids = [(f"{pname}.{name}" if pname else name, child) for name, child in parent.named_children()]
        for a, b in itertools.pairwise(kids):
            yield pname, parent, a, b


def _gain_width(module: nn.Module, widths: set[int]) -> int | None:
    """The number of channels ``module`` scales one by one if it is a LayerNorm, RMSNorm or GroupNorm
    (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, or a LayerNorm/RMSNorm written in model code with a gain of
    that many elements: vit-pytorch's CvT normalises a ``[B, C, H, W]`` map over C with a ``[1, C, 1, 1]`` gain) of
    one of ``widths``, else ``None``."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        width = module.normalized_shape[-1] if module.normalized_shape else None
        return width if width in widths else None
    if isinstance(module, nn.GroupNorm):  # (its gain is per channel too: GroupNorm(1, C) in timm's LowFormer)
        return module.num_channels if module.affine and module.num_channels in widths else None
    own = [p for p in module.parameters(recurse=False) if p.numel() in widths and p.numel() == max(p.shape, default=1)]
    if not own or len({p.numel() for p in own}) != 1 or kind_of(module) not in ("layernorm", "rmsnorm"):
        return None
    return own[0].numel()


def _block_of(model: nn.Module, name: str) -> str:
    """The name of the block holding the module ``name``: its parent, or the first ancestor above it that holds more
    than one child (a module wrapping a norm alone, to permute a channels-first map around it, is part of the norm)."""
    holder = name.rpartition(".")[0]
    while holder and len(model.get_submodule(holder)._modules) == 1:
        holder = holder.rpartition(".")[0]
    return holder


def _excluded(pol: Policy, name: str, module: nn.Module, filter_fn: FilterFn | None) -> bool:
    """Whether the user excluded ``module`` by name (a policy ``exclude`` pattern) or by ``filter_fn``: the calls
    in its code are then not routed either."""
    by_name = matches(name, pol.exclude)
    return by_name or (filter_fn is not None and not filter_fn(module, name))


def _numbered(model: nn.Module) -> dict[str, str]:
    """``{name: "kind:i"}``: each module slimact converts or routes is the ``i``-th of its kind in ``named_modules()``
    order, what ``Policy.exclude_index`` names. Every such module counts, whatever the policy: the parts a fused
    block computes itself (a gated MLP's down projection) and the attention modules routed through transformers'
    AttentionInterface too, so that an index names the same module under every policy."""
    counts: Counter[str] = Counter()
    out = {}
    for name, module in model.named_modules():
        found = recognise(module)
        if found.replace is not None or (found.kind == "attention" and uses_attention_interface(module)):
            out[name] = f"{found.kind}:{counts[found.kind]}"
            counts[found.kind] += 1
    return out


def _index(numbered: dict[str, str], name: str) -> int:
    return int(numbered[name].rpartition(":")[2]) if name in numbered else -1


def _excluded_parts(pol: Policy, name: str, module: nn.Module, parts: tuple[str, ...],
                    filter_fn: FilterFn | None, numbered: dict[str, str]) -> str | None:
    """Why a module whose replacement computes some of its children itself (a gated MLP's down projection and
    activation, ``nn.MultiheadAttention``'s ``out_proj``) stays as written: the user excluded one of those children
    (a policy ``exclude`` pattern or ``exclude_index`` entry, ``filter_fn``), which the fused replacement would
    compute, and keep for, all the same. ``None`` if none is excluded."""
    excluded = [part for part in parts if (child := module._modules.get(part)) is not None
                and (_excluded(pol, full := f"{name}.{part}" if name else part, child, filter_fn)
                     or numbered.get(full) in pol.exclude_index)]
    if not excluded:
        return None
    return (f"its {', '.join(excluded)} excluded by the policy or filter_fn, which slimact's fused "
            f"{type(module).__name__} would compute itself: left as written, its other parts converted on their own")


def _untag_attention(model: nn.Module) -> None:
    """Drop the attention tags and the running estimates they gathered from every module of ``model``."""
    for module in model.modules():
        module.__dict__.pop(attention.SEEN_ATTR, None)
        module.__dict__.pop(attention.ORIGINAL_ATTR, None)
        if module.__dict__.pop(attention.POLICY_ATTR, None) is not None:
            clear_state(module)
            if not isinstance(module, SlimModule):  # (its call-site count, as attach gives a converted module)
                for key in ("_slimact_steps", "_slimact_step", "_slimact_site"):
                    module.__dict__.pop(key, None)


def convert(
    model: nn.Module,
    policy: str | os.PathLike[str] | Policy = "int8",
    *,
    filter_fn: FilterFn | None = None,
) -> nn.Module:
    """Convert ``model``'s layers in place to slimact's; returns ``model``.

    Args:
        model: any ``nn.Module``.
        policy: a preset name (``"int8"``, ``"mesa"``, ``"tempo"``), a :class:`slimact.Policy`, or the path of
            a TOML/JSON policy file.
        filter_fn: ``filter_fn(module, qualified_name) -> bool``; modules for which it returns ``False`` are
            left alone (asked of each module on its own, as torchao's is; a policy ``exclude`` pattern naming a
            block covers the modules inside it).

    Idempotent: converting again (with the same or another policy) re-applies the policy to every module. Where it
    raises midway (a ``filter_fn``'s error), the model is left plain (:func:`revert`), not half converted.
    """
    pol = resolve(policy)
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "the model is a TorchScript module (torch.jit.script or trace): its compiled code calls no Python module "
            "or hook, so slimact can replace none of its layers. Convert the Python model (a scripted submodule "
            "inside one is left as written)."
        )
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "the model has parameters on the meta device: slimact recognises some layers (gated MLPs, norms and "
            "activations of model-specific classes) by running them on a probe, which needs real weights. "
            "Materialise the model first (e.g. model.to_empty(device=...) and initialise or load its weights), "
            "then convert it."
        )
    if any(is_dtensor(p) for p in model.parameters()):
        # (FSDP2's fully_shard, or tensor parallelism, ran first: the probes that recognise layers by running them
        # mixed the sharded parameters with plain tensors, "aten.add_.Tensor got mixed torch.Tensor and DTensor")
        raise ValueError(
            "the model's parameters are DTensors (fully_shard or tensor parallelism was applied first): convert the "
            "model before sharding it, then fully_shard its blocks and the model (docs/integrations.md)"
        )
    if any(nn.parameter.is_lazy(t) for t in itertools.chain(model.parameters(), model.buffers())):
        # A lazy module (nn.LazyLinear, LazyConv2d, LazyBatchNorm2d) turns itself into its plain class at its first
        # call, from inside that call: a converted one lost slimact's class mid-forward (AttributeError), and the
        # probes that recognise gated MLPs would initialise its parameters with the probe's shapes.
        raise ValueError(
            "the model has uninitialised (lazy) parameters: run one forward with a real batch first, so that lazy "
            "modules (nn.LazyLinear, nn.LazyConv2d, ...) take their shapes and become their plain classes, then "
            "convert it."
        )
    # (a typo in a pattern protects nothing, or, in include, converts nothing: said, as for exclude_index; before
    # anything changes, so that a warning turned into an error leaves the model as it was)
    names = [name for name, _ in model.named_modules() if name] + ["(loss)", FUNCTIONAL_NAME]
    for field_name, effect in (("include", "converted"), ("exclude", "left alone")):
        idle = [p for p in getattr(pol, field_name) if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if idle:
            warnings.warn(f"slimact.convert: policy {field_name} pattern(s) {idle} match no module of this model "
                          f"(qualified names such as {names[:3]}): nothing is {effect} for them", stacklevel=2)
    try:
        return _convert(model, pol, filter_fn)
    except BaseException:
        # (a filter_fn or a probe raising midway left some modules converted, no routing, no attention
        # setting, and summary saying "not converted": the model is left plain instead)
        revert(model)
        raise


def _convert(model: nn.Module, pol: Policy, filter_fn: FilterFn | None) -> nn.Module:
    """:func:`convert` of a model it has checked."""
    if filter_fn is not None:  # asked of each module as the plain model has it, converted by an earlier call or not
        # (a filter on the class, ``type(m) is nn.LayerNorm``, or on its module path, saw slimact's classes on a second
        # convert and let them all through)
        user_filter = filter_fn

        def filter_fn(module: nn.Module, name: str) -> bool:
            with as_written(module):
                return user_filter(module, name)

    for sub in itertools.islice(model.modules(), 1, None):
        # A submodule converted on its own before: its modules are converted again below, with this policy, and the
        # routing it installed (its policy's, for the calls in its code) would outrank this conversion's.
        _unroot(sub)
    steps = model.__dict__.get(_HOOK_ATTR, (None, None))[1] or StepCounter()
    skipped: dict[str, str] = {}
    fused: set[str] = set()  # modules a converted parent computes itself
    # (8-bit for any kind: a lossless policy turning it on for one kind in per_kind needs the guard as much)
    scale_free = _scale_free_chains(model) if pol.quantizes else {}
    scale_free.update(_relus_into_layers_as_written(model, pol))
    forget(model.modules())  # recognised afresh: attributes, hooks and children may have changed since
    with as_written(model), recognising(model):
        # ... and as on the plain model: a part converted by an earlier policy would hide a gated MLP from its probe.
        # (_numbered recognises every module)
        numbered = _numbered(model)
    # (a Mesa policy file names layers by index: one written for another model may name none of this one's)
    unmatched = [e for e in pol.exclude_index if e not in numbered.values() and not e.startswith("lmloss:")]
    if unmatched:
        warnings.warn(f"slimact.convert: exclude_index {unmatched} name no module of this model (it has "
                      f"{dict(Counter(v.rpartition(':')[0] for v in numbered.values()))}, counted from 0): "
                      "nothing is left alone for them", stacklevel=3)
    for name, module in model.named_modules():
        slim_cls, unsupported, found = _replacement(module)
        if name in fused:
            detach(module)
            skipped[name] = _COMPUTED_BY_PARENT
            continue
        if slim_cls is None:
            detach(module)  # (converted by an earlier call, recognised no more: an attribute changed since)
            if unsupported is not None:
                skipped[name] = unsupported
            continue
        kind = found.kind
        # (the user's or the policy's own reason first: a module they left out says so, not why slimact would)
        reason = (_leave_alone(pol, kind, name, module, filter_fn, _index(numbered, name)) or scale_free.get(name)
                  or _excluded_parts(pol, name, module, found.parts, filter_fn, numbered))
        if reason is not None:
            detach(module)
            skipped[name] = reason
            continue
        # (a module written in model code: what its forward reads besides its tensors, as its probe ran)
        layout = found.extra.get("layout")
        live = () if layout is None else tuple(n for n in (layout.gate, layout.up, layout.gate_up) if n is not None)
        probed = probed_state(module, found.parts, live) if written_in_model_code(_cls(module)) else None
        attach(module, slim_cls, pol, kind, steps, probed=probed, **found.extra)
        fused.update(f"{name}.{part}" if name else part for part in found.parts)
    _route_calls(model, pol, skipped, filter_fn, numbered)
    _route_attention(model, pol, skipped, filter_fn, steps, numbered)
    if _HOOK_ATTR not in model.__dict__:
        handles = (model.register_forward_pre_hook(steps), model.register_forward_hook(steps.end, always_call=True))
        model.__dict__[_HOOK_ATTR] = (handles, steps)
    model.__dict__.setdefault("__prepare_scriptable__", refuse_script)
    model.__dict__[_POLICY_ATTR] = pol
    model.__dict__[_SKIPPED_ATTR] = skipped
    return model


def _copied(model: nn.Module, caller: str = "check", detached: list[str] | None = None) -> nn.Module:
    """A deep copy of ``model``, where PyTorch's own ``copy.deepcopy`` refuses one that trains.

    PyTorch cannot copy a tensor that is not a graph leaf, and modules hold such tensors as attributes: the hook-based
    reparametrizations (``torch.nn.utils.prune``'s ``weight = weight_orig * mask``, the old ``weight_norm``,
    ``spectral_norm``), whose forward pre-hook computes it afresh at every call; a view of a parameter made once
    (``self.wt = self.proj.weight.t()``), made again on the copy's parameter where the copy lays the parameter out as
    the model does, so gradients flow through it as in the model (the same object wherever the model holds it); and a
    forward's own leftovers (MONAI's DynUNet keeps its last deep-supervision outputs in a list), copied detached, as
    is a view the copy cannot make again (a parameter at an offset in a larger storage, a complex or conjugate view),
    their names appended to ``detached`` (a gradient through one is in neither copy). ``staticmethod`` objects held
    as attributes (rotary-embedding-torch's), which cannot be copied, are shared. Anything else that cannot be copied
    is a clear error."""
    memo: dict[int, Any] = {}
    try:
        for name, module in model.named_modules():
            recomputed = {_recomputed_attribute(hook) for hook in module._forward_pre_hooks.values()}
            for key, value in vars(module).items():
                if isinstance(value, (staticmethod, classmethod)):
                    memo[id(value)] = value
                for label, t in _held_tensors(key, value):
                    if t.is_leaf or id(t) in memo:
                        continue
                    remade = None if label in recomputed else _view_again(t, memo)
                    memo[id(t)] = t.detach().clone() if remade is None else remade
                    if remade is None and label not in recomputed and detached is not None:
                        detached.append(f"{name}.{label}" if name else label)
        return copy.deepcopy(model, memo)
    except Exception as e:
        raise TypeError(f"slimact.{caller} runs deep copies of the model, and copy.deepcopy fails on this one "
                        f"({type(e).__name__}: {e}); {caller} a copy of the model you can make, or a model built "
                        "the same way") from e


def _view_again(t: Tensor, memo: dict[int, Any]) -> Tensor | None:
    """``t``, a view of a leaf tensor (a parameter), made on the copy of that leaf (copied into ``memo`` now), or
    ``None`` where the copy would not map each element to the same one: the copy must lay the leaf out as it is
    (offset, strides; a parameter at an offset in a larger storage is copied to offset 0) and the view be a plain
    strided one of the leaf's dtype (not complex, conjugate or negative)."""
    base = t._base
    if (base is None or not base.is_leaf or t.dtype != base.dtype or t.is_conj() or t.is_neg()
            or base.is_conj() or base.is_neg()
            or t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()):
        return None  # (the last: a view made before the parameter's .data was replaced reads the old storage)
    twin = copy.deepcopy(base, memo)
    if twin.storage_offset() != base.storage_offset() or twin.stride() != base.stride():
        return None
    return twin.as_strided(t.size(), t.stride(), t.storage_offset())


def _held_tensors(key: str, value: Any, depth: int = 0) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the tensors a module attribute holds: itself, those in its lists, tuples and dicts (a few
    levels down), the module's buffers by their own names (parameters, leaves, aside)."""
    if isinstance(value, Tensor):
        yield key, value
    elif depth > 3 or key in ("_parameters", "_modules"):
        return
    elif key == "_buffers":
        for name, t in value.items():
            yield from _held_tensors(name, t, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _held_tensors(f"{key}[{k!r}]", v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _held_tensors(f"{key}[{i}]", v, depth + 1)
    elif not isinstance(value, (nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType)):
        # An object of the model's own holding a forward's output: stable-baselines3's action distribution (its torch
        # Categorical's logits), gpytorch's memoised LinearOperators (a sweep: summary and check refused to copy them)
        for k, v in getattr(value, "__dict__", {}).items():
            yield from _held_tensors(f"{key}.{k}", v, depth + 1)


def _recomputed_attribute(hook: Any) -> str | None:
    """The attribute a reparametrization's forward pre-hook computes before each call, for PyTorch's own."""
    if isinstance(hook, BasePruningMethod):
        return hook._tensor_name
    if isinstance(hook, (WeightNorm, SpectralNorm)):
        return hook.name
    return None


def _left_plain_by(routing: Routing, model: nn.Module) -> bool:
    """Whether ``routing`` leaves ``model`` as written: it, or a module holding it, was reverted in the converted
    model (its hooks stay on it, to keep its calls as written)."""
    return any(model is m or any(model is sub for sub in m.modules()) for m in routing.excluded)


def _conversion_policies(model: nn.Module) -> list[Policy]:
    """The distinct policies ``model``'s conversions were made with: its own, those of converted models it holds
    (peft's wrapper around one), those its slimact modules and routed attention carry (a block converted again under
    another policy), and those of the routings whose hooks are on its modules (a block of a converted model whose
    work is routed calls alone). Empty for a plain model."""
    found = [r.__dict__[_POLICY_ATTR] for _, r in model.named_modules() if _POLICY_ATTR in r.__dict__]
    routings: dict[int, Routing] = {}
    for module in model.modules():
        found += [p for p in (module.__dict__.get("_slimact_policy"), module.__dict__.get(attention.POLICY_ATTR))
                  if p is not None]
        routings.update((id(r), r) for hook in module._forward_pre_hooks.values()
                        if (r := _routing_of(hook)) is not None)
    found += [r.policy for r in routings.values() if not _left_plain_by(r, model)]
    distinct: list[Policy] = []
    for p in found:
        if not any(p == q for q in distinct):
            distinct.append(p)
    return distinct


def _lm_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The model's language-model head and its qualified name: Hugging Face's ``get_output_embeddings()``, else its
    one module named ``lm_head`` (nanoGPT's, nanochat's, minGPT's, LitGPT's; at any depth, for a model held in a
    training wrapper), else none (two such modules: which is this model's is a guess)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is not None:
        return next(((name, m) for name, m in model.named_modules() if m is head), ("", head))
    named = [(name, m) for name, m in model.named_modules() if name.rpartition(".")[2] == "lm_head"]
    return named[0] if len(named) == 1 else None


def _route_calls(model: nn.Module, pol: Policy, skipped: dict[str, str], filter_fn: FilterFn | None,
                 numbered: dict[str, str]) -> None:
    """Route the LM loss, functional dropout/activations in model code, and the products and softmaxes of
    attention modules that compute attention in their own code through slimact (:mod:`slimact.nn.routing`), as
    far as the policy wants them."""
    old = model.__dict__.pop(_ROUTE_ATTR, None)
    if old is not None:
        old.remove()
    head_name, head = _lm_head(model) or ("", None)
    # (before the check below: a head left alone for its weight is not recognised as a Linear there)
    if isinstance(head, nn.Linear) and (foreign := foreign_linear_weight(head)) is not None:
        skipped["(loss)"] = (f"its head {head_name}'s weight is a {foreign} (a tensor subclass, a quantised weight): "
                             "the fused loss would compute with it as a plain tensor: computed as written")
        head = None
    # Only a head that computes a plain Linear: the loss is recomputed from its input and weight (a subclass
    # whose forward scales or caps the logits would lose that, and its parameters' gradients).
    head = head if isinstance(head, nn.Linear) and recognise(head).replace == "linear" else None
    # (one loss per model: "lmloss:0" names it)
    if head is not None and (reason := pol.skip_reason("lmloss", "(loss)", 0)) is not None:
        skipped["(loss)"] = reason
        head = None  # (an exclude pattern naming "(loss)": no loss routed, as the summary says)
    if head is not None and _excluded(pol, head_name, head, filter_fn):
        # The routed loss computes the head's product itself (in chunks, from its input and weight): a head the user
        # left alone by name or filter_fn (a hook on it, a head of their own) is not computed by slimact either.
        skipped["(loss)"] = f"its head {head_name} is excluded (filter_fn or an exclude pattern): computed as written"
        head = None
    # (an attention module excluded by index is routed, not replaced: not in skipped yet, so named here, or the
    # scaled_dot_product_attention in its code would still be routed)
    excluded = [m for name, m in model.named_modules() if name and (
        _excluded(pol, name, m, filter_fn) or (name in skipped and recognise(m).replace is not None)
        or numbered.get(name) in pol.exclude_index)]
    own = [(name, m) for name, m in model.named_modules() if name not in skipped and kind_of(m) == "attention"
           and not any(isinstance(sub, SlimModule) for sub in m.modules() if kind_of(sub) == "attention")
           and (filter_fn is None or filter_fn(m, name))]
    # Experts modules whose clamped gated unit slimact computes (the silu kind's codes), unless left alone by name
    excluded_ids = {id(m) for m in excluded}
    as_written = [name for name, m in model.named_modules() if id(m) in excluded_ids]
    gates = [(m, form) for name, m in model.named_modules()
             if pol.skip_reason("silu", name) is None and not any(_at_or_under(name, n) for n in as_written)
             and (filter_fn is None or filter_fn(m, name)) and (form := gate_form(m)) is not None]
    routing = Routing(model, pol, head, excluded, own, gates)
    # (with no call to route, still for an encoder layer converted on its own: its fused eval path is refused for
    # the step counter's hooks on it otherwise)
    if routing.handlers or routing.gated or routing.encoders:
        model.__dict__[_ROUTE_ATTR] = routing
    else:
        routing.remove()


def _configs_below(config: Any) -> list[Any]:
    """``config`` and its sub-configurations, recursively (a vision tower's, a text model's)."""
    found, todo = [], [config]
    while todo:
        c = todo.pop()
        if c is None or any(c is f for f in found) or not hasattr(c, "_attn_implementation"):
            continue
        found.append(c)
        todo += [getattr(c, key, None) for key in getattr(c, "sub_configs", {}) or {}]
    return found


#: The attention settings whose math slimact's attention function reproduces: transformers' own scaled-dot-product
#: attention, whichever kernel computes it (and slimact's own, on a configuration whose earlier setting is not known
#: here), where the function registered under the name is transformers' own. Anything else (a function registered by
#: the user, under a new name or over one of these, as sequence-parallel wrappers do; a hub kernel; the paged variants
#: of continuous batching; no setting) is left as written.
_REPRODUCED = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention",
               attention.NAME, attention.EAGER_NAME)


def _unknown_setting(config: Any) -> str | None:
    """Why the attention modules reading ``config`` are left as written (its setting is not one slimact's attention
    reproduces), or ``None``."""
    chosen = attention.setting(config)
    if chosen is None:  # (transformers then builds no mask: a causal model attends to every key, eagerly)
        return "config._attn_implementation is None (no mask, eager attention): left as written"
    if chosen not in _REPRODUCED:
        return (f"config._attn_implementation is {chosen!r}, an attention function slimact does not know: "
                "left as written")
    fn = attention.registered(chosen)
    own = {"eager": None, **dict.fromkeys((attention.NAME, attention.EAGER_NAME), attention.attention_forward)}
    if fn is own[chosen] if chosen in own else getattr(fn, "__module__", "").startswith("transformers.integrations."):
        return None
    return (f"config._attn_implementation is {chosen!r}, but the function registered under that name is not "
            f"transformers' own ({getattr(fn, '__qualname__', type(fn).__name__)}): left as written")


def _route_attention(model: nn.Module, pol: Policy, skipped: dict[str, str], filter_fn: FilterFn | None,
                     steps: StepCounter, numbered: dict[str, str]) -> None:
    """Select slimact's attention function on a Hugging Face model and tag its attention modules.

    A module is tagged only if its forward calls transformers' ``AttentionInterface``; a configuration is
    switched only if no attention module reading it branches on the setting in its own code (Falcon's tests
    ``== "sdpa"`` and otherwise computes scores with an eager mask: switching it would change its forward).
    Each configuration object is switched on its own (sub-configurations too, without the property's
    recursion), shared ones are counted (two models on one config: the last ``revert`` restores it). ``numbered``: each
    module's ``"kind:i"`` for ``exclude_index`` (:func:`_numbered`).
    """
    _untag_attention(model)
    attention.release_configs(model, model.__dict__.pop(_ATTN_ATTR, ()))
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return
    candidates, branching = [], set()
    eager_only = tuple(f"{name}." if name else "" for name, m in model.named_modules()
                       if getattr(m, "_supports_sdpa", None) is False)
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None)
        if kind_of(m) != "attention" or not hasattr(cfg, "_attn_implementation"):
            continue
        if uses_attention_interface(m):
            candidates.append((name, m))
        elif "_attn_implementation" in forward_names(m):
            branching.add(id(cfg))
            skipped.setdefault(name, f"{type(m).__name__} chooses its attention from config._attn_implementation in "
                                     "its own code (not through transformers' AttentionInterface): left as written")
    tagged, eager_masks = [], set()
    for name, module in candidates:
        reason = _leave_alone(pol, "attention", name, module, filter_fn, _index(numbered, name))
        if reason is None and (name + ".").startswith(eager_only):
            # Written for eager attention alone: converted only where that attention is SDPA with sinks, and then
            # with eager attention's masks and name, as its model code was written for.
            if attention.eager_is_sdpa_with_sinks(module):
                eager_masks.add(id(module.config))
            else:
                reason = _EAGER_ONLY
        if reason is None:
            reason = _unknown_setting(module.config)
        if reason is None and id(module.config) in branching:
            reason = ("its configuration is also read by an attention module that branches on "
                      "config._attn_implementation: left as written")
        if reason is not None:
            skipped[name] = reason
            continue
        tagged.append(module)
    if not tagged:
        return
    for module in tagged:
        module.__dict__[attention.POLICY_ATTR] = pol
        module.__dict__["_slimact_steps"] = steps  # (the model's pass count: one running estimate per call site)
    attention.register()
    configs = [c for root in (config, *(m.config for m in tagged)) for c in _configs_below(root)]
    records = model.__dict__[_ATTN_ATTR] = attention.switch_configs(
        model, [c for c in configs if id(c) not in branching and _unknown_setting(c) is None], eager_masks)
    originals = {id(c): original for c, original in records}
    for module in model.modules():
        if id(getattr(module, "config", None)) in originals:
            module.__dict__[attention.ORIGINAL_ATTR] = originals[id(module.config)]


#: Why transformers' AttentionInterface is not switched for an attention module (its eager products and softmaxes
#: are still routed where the policy compresses them: summary then reports it converted, by its products).
_EAGER_ONLY = ("its model declares _supports_sdpa = False (transformers runs its attention eager only; slimact "
               "switches such attention only where its eager function is SDPA with attention sinks, gpt-oss's): left "
               "as written")


def _unroot(module: nn.Module) -> None:
    """Remove what ``convert(module)`` installed on ``module`` itself (its step hooks, the routing of the calls in
    its code, its attention setting), if it was the root of a conversion."""
    hook = module.__dict__.pop(_HOOK_ATTR, None)
    if hook is not None:
        for handle in hook[0]:
            handle.remove()
    routing = module.__dict__.pop(_ROUTE_ATTR, None)
    if routing is not None:
        routing.remove()
    attention.release_configs(module, module.__dict__.pop(_ATTN_ATTR, ()))
    module.__dict__.pop(_POLICY_ATTR, None)
    module.__dict__.pop(_SKIPPED_ATTR, None)
    if module.__dict__.get("__prepare_scriptable__") is refuse_script:
        del module.__dict__["__prepare_scriptable__"]


def revert(model: nn.Module) -> nn.Module:
    """Restore every converted module of ``model`` to its original class, in place; returns ``model``.

    A submodule converted on its own (``convert(model.encoder)``) is reverted too, with the routing of the calls in
    its code: the model is plain again. A block of a model converted as a whole (``revert(model.encoder)`` after
    ``convert(model)``) is plain from then on, the calls in its code too (they ran through the model's routing,
    compressed); the rest of the model stays converted. A module another converted model holds too (a block two
    models share) is plain in both: its class is restored, and no routing's hooks are left on it."""
    return _revert(model, routings_around(model))


def _revert(model: nn.Module, outer: list[Routing]) -> nn.Module:
    """:func:`revert`, ``model`` staying a block of the converted models whose routings are ``outer`` (left as written
    there); with none, ``model`` is plain in every respect: ``check``'s and ``summary``'s plain copy of a block of a
    converted model (``revert`` of it registered each copy with the model's routing, which grew with every check)."""
    for module in model.modules():
        detach(module)
        _unroot(module)
    _untag_attention(model)
    for routing in outer:
        routing.leave_as_written(model)
    drop_routing_hooks(model, keep=outer)
    return model


def _plain_copy(model: nn.Module, caller: str = "check", detached: list[str] | None = None) -> nn.Module:
    """A plain copy of ``model`` (:func:`_copied`, every conversion and routing hook removed), for ``check`` and
    ``summary``: it belongs to no converted model."""
    return _revert(_copied(model, caller, detached), [])


@dataclass
class Summary:
    """What ``convert`` did to a model. ``str(summary)`` is a readable report."""

    policy: str | None
    converted: dict[str, int] = field(default_factory=dict)  # kind -> modules converted
    skipped: dict[str, str] = field(default_factory=dict)  # qualified name -> why it was left alone
    modules: dict[str, str] = field(default_factory=dict)  # converted qualified name -> kind
    #: Share of the plain model's activation bytes kept by converted modules (``summary(model, inputs)``).
    coverage: float | None = None
    #: Plain-model bytes outside converted modules, by module (``summary(model, inputs)``).
    uncovered: dict[str, int] = field(default_factory=dict)
    #: Kinds of functional calls in model code routed through slimact (``F.dropout``, ``F.gelu``...).
    functional: list[str] = field(default_factory=list)
    #: Things worth knowing that are not a conversion (float64 layers kept exact...).
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        # (modules converted as part of another model, a PeftModel's before merge_and_unload: the header had said "not
        # converted" above "converted 22 module(s)")
        root = "none: model not converted" if not self.converted else "none at this model, which was not converted"
        lines = [f"slimact summary (policy: {self.policy or root})"]
        total = sum(self.converted.values())
        lines.append(f"converted {total} module(s)")
        lines += [f"  {kind:<12} {n:>5}" for kind, n in sorted(self.converted.items())]
        if self.functional:
            # (the kinds the policy routes wherever model code calls them, not calls seen)
            # ("linear" there is torch._grouped_mm, MoE experts' products: F.linear in model code is not routed, which
            # the kind's name alone had let a reader take it for)
            shown = [_ROUTED_AS.get(kind, kind) for kind in self.functional]
            lines.append(f"routed in model code {FUNCTIONAL_NAME}, where called: {', '.join(shown)}")
        if self.coverage is not None:
            lines.append(f"coverage: {self.coverage:.1%} of the plain model's activation bytes handled by slimact")
            for name, n in sorted(self.uncovered.items(), key=lambda kv: -kv[1])[:5]:
                lines.append(f"  not covered: {name or '(model itself)'}: {n / 2**20:.2f} MiB")
        lines += [f"note: {note}" for note in self.notes]
        if self.skipped:
            lines.append(f"left alone {len(self.skipped)} module(s):")
            by_reason = Counter(self.skipped.values())
            for reason, n in by_reason.most_common():
                names = [m for m, r in self.skipped.items() if r == reason]
                shown = ", ".join(names[:4]) + (f", ... ({n - 4} more)" if n > 4 else "")
                lines.append(f"  {n:>5} x {reason}: {shown}")
        return "\n".join(lines)


def _inner_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the outermost submodules of ``model`` that ``convert`` was called on."""
    roots = [(name, m) for name, m in model.named_modules() if name and _POLICY_ATTR in m.__dict__]
    return [(name, m) for name, m in roots
            if not any(name != other and _at_or_under(name, other) for other, _ in roots)]


def _wrapped(model: nn.Module, roots: list[tuple[str, nn.Module]], inputs: Any, loss_fn) -> Summary:
    """:func:`summary` of ``model``, which holds the converted modules ``roots`` (``(name, module)``: peft's
    ``PeftModel`` around a model converted before, a head added to a converted backbone, blocks converted each on
    their own): their summaries, their names as ``model``'s; the modules outside them left alone as such; the
    coverage (with ``inputs``) measured through ``model``'s forward. Before, it read "policy: none: model not
    converted" above the count of converted modules, and called the modules outside "no slimact replacement yet"."""
    found = Summary(policy=None)
    for prefix, root in roots:
        part = summary(root)
        found.policy = ", ".join(dict.fromkeys(filter(None, (found.policy, part.policy))))
        found.modules.update({_under(prefix, n): k for n, k in part.modules.items()})
        found.skipped.update({_under(prefix, n): r for n, r in part.skipped.items()})
        found.functional += [k for k in part.functional if k not in found.functional]
        found.notes += [n for n in part.notes if n not in found.notes]
    found.converted = dict(Counter(found.modules.values()))
    names = ", ".join(prefix for prefix, _ in roots)
    for name, module in model.named_modules():
        outside = not any(_at_or_under(name, prefix) for prefix, _ in roots) and next(module.children(), None) is None
        if outside and not _glue(module):
            found.skipped[name] = (f"outside {names}, which convert was called on: convert {type(model).__name__} "
                                   "to convert it")
    found.notes.append(f"converted as {names} (convert was called on each); names as {type(model).__name__}'s")
    if inputs is not None:
        routing = roots[0][1].__dict__.get(_ROUTE_ATTR) if len(roots) == 1 else None
        found.coverage, found.uncovered, *_ = _coverage(model, set(found.modules), inputs, loss_fn, routing)
    return found


def _glue(module: nn.Module) -> bool:
    """Whether a leaf module is parameterless glue (identity, flatten...): it keeps nothing worth reporting. (A norm
    without parameters is not: an InstanceNorm without affine keeps its input, as the affine one does, and was
    missing from the summary's list where the affine one was named.)"""
    return (kind_of(module) == "other" and not any(True for _ in module.parameters(recurse=False))
            and not isinstance(module, nn.modules.instancenorm._InstanceNorm))


def _under(prefix: str, name: str) -> str:
    """``name`` (a summary's, of a module of the model named ``prefix``) as the outer model's."""
    return name if name.startswith("(") else f"{prefix}.{name}" if name else prefix


def _at_or_under(name: str, prefix: str) -> bool:
    """Whether the module named ``name`` is the one named ``prefix`` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


#: Per kind, the function whose calls in a module's own code the routing sends through slimact.
_ROUTED_CALLS = {"attention": "scaled_dot_product_attention", "layernorm": "layer_norm", "rmsnorm": "rms_norm",
                 "groupnorm": "group_norm", "gelu": "gelu", "silu": "silu", "relu": "relu", "dropout": "dropout"}


def _call_routable(module: nn.Module, kind: str) -> bool:
    """Whether the routed call in ``module``'s own code can be routed, as far as its attributes tell: a norm over
    more than the last dim (``nn.LayerNorm([T, C])``, a 2-d weight) and an in-place ReLU, SiLU or dropout run as
    written (the routes decline them), so such a module is not reported converted."""
    if kind in ("layernorm", "rmsnorm", "groupnorm"):
        shape = getattr(module, "normalized_shape", None)
        if shape is not None and not isinstance(shape, int) and len(tuple(shape)) != 1:
            return False
        return all(not isinstance(t, torch.Tensor) or t.dim() == 1
                   for t in (getattr(module, "weight", None), getattr(module, "bias", None)))
    if kind in ("relu", "silu", "dropout"):
        return not getattr(module, "inplace", False)
    return True


def summary(model: nn.Module, inputs: Any = None, *, loss_fn: Callable[[Any], Any] | None = None) -> Summary:
    """What was converted (per kind), and every module left alone with the reason.

    With ``inputs`` (as for :func:`slimact.profile`; a small batch is enough), also the coverage: a plain
    copy of the model (converted modules reverted) is profiled on them, and the share of its activation
    bytes kept inside converted modules (or their children) is reported; with the LM loss routed, the
    bytes kept by the model's own code (where Hugging Face computes the loss) count as the loss's.
    """
    pol: Policy | None = model.__dict__.get(_POLICY_ATTR)
    if pol is None and (inner := _inner_roots(model)):
        return _wrapped(model, inner, inputs, loss_fn)
    skipped = dict(model.__dict__.get(_SKIPPED_ATTR, {}))
    modules: dict[str, str] = {}
    routing: Routing | None = model.__dict__.get(_ROUTE_ATTR)
    watched = routing.watched if routing is not None else {}
    # Modules whose calls run as written (excluded, or inside an excluded one): none of their calls is routed.
    excluded = {id(m) for m in routing.excluded} if routing is not None else set()
    as_written = [n for n, m in model.named_modules() if id(m) in excluded]
    reverted = {id(m) for m in getattr(routing, "reverted", ())} if routing is not None else set()
    reverted_names = [n for n, m in model.named_modules() if id(m) in reverted]
    # Reported converted as the attention calls in their code are routed (their products and softmaxes, or the
    # F.scaled_dot_product_attention their forward mentions): with inputs, kept only where one was routed.
    by_products: set[str] = set()
    # Of those, the ones reported for an F.scaled_dot_product_attention call their code may make (diffusers'
    # Attention, whose processor makes it): with inputs, kept only where the routed call keeps fewer bytes than
    # PyTorch's kernel (a lossless policy's attention keeps what the CPU flash kernel keeps).
    by_sdpa: set[str] = set()
    sdpa_on = routing is not None and "attention" in routing.kinds
    fell_back: list[str] = []  # (converted modules running their own code: a value they read changed)
    for name, module in model.named_modules():
        routed = routing is not None and not any(_at_or_under(name, n) for n in as_written)
        products = bool({"matmul", "softmax"} & watched.get(name, set()))  # its products and softmaxes are routed
        if isinstance(module, SlimModule) and (changed := module._slimact_changed()):
            # (it runs its own code now, with the warning its call gave: it kept what PyTorch keeps where summary
            # called it converted, coverage 1.0; a review)
            skipped[name] = (f"{', '.join(changed)} changed since convert recognised what its forward computes: it "
                             "runs its own code, as written; slimact.convert(model) again recognises it afresh")
            fell_back.append(name)
        elif any(name != n and _at_or_under(name, n) for n in fell_back) and skipped.get(name, "").startswith(
                "computed by its parent"):
            # (a fused gated MLP's parts run as written with it: "computed by its parent" no more; a review)
            skipped[name] = "its parent runs its own code (a value it reads changed since convert): run as written"
        elif isinstance(module, SlimModule):
            modules[name] = kind_of(module)
        elif attention.POLICY_ATTR in module.__dict__:
            modules[name] = "attention"
        elif name in as_written and name not in skipped:
            skipped[name] = ("reverted after convert (slimact.revert of it): plain, the calls in its code as "
                             "written too" if id(module) in reverted else
                             "excluded (filter_fn or an exclude pattern): left as written, the calls in its code too")
        elif name not in skipped and (holder := next((n for n in reverted_names if _at_or_under(name, n)), None)):
            skipped[name] = f"inside {holder}, reverted after convert: plain"
        elif (routed and (kind := kind_of(module)) in routing.kinds
              and _ROUTED_CALLS.get(kind, "") in forward_names(module, through_super=True)
              and _call_routable(module, kind)):
            # Its own code calls the functional form slimact routes (nanoGPT's LayerNorm calls F.layer_norm, timm's
            # attention F.scaled_dot_product_attention), or its base class's does, reached through super().forward
            # (a GroupNorm subclass left alone that scales super().forward(x): F.group_norm routed). A watched
            # attention module may not call it on every path (timm's with fused_attn off computes q @ k^T, softmax
            # and @ v, which a lossless policy leaves as written).
            modules[name] = kind
            skipped.pop(name, None)
            if kind == "attention" and name in watched:
                by_products.add(name)
        elif (name and (name not in skipped or (skipped[name] == _EAGER_ONLY and products))
              and kind_of(module) == "attention"
              and not any(attention.POLICY_ATTR in sub.__dict__
                          or (isinstance(sub, SlimModule) and sub._slimact_kind == "attention")
                          for sub in module.modules())):
            # attention computed in the module's own code (a wrapper around a routed one is fine)
            if products:
                # (also where transformers' AttentionInterface was not switched for it, a model declaring
                # _supports_sdpa = False: "left as written" there while its eager products were routed, a sweep)
                skipped.pop(name, None)
                modules[name] = "attention"
                by_products.add(name)
                continue
            sdpa_call = sdpa_on and "attention" in watched.get(name, set())
            if sdpa_call and inputs is not None:
                modules[name] = "attention"
                by_products.add(name)
                by_sdpa.add(name)
                continue
            skipped[name] = (
                f"{type(module).__name__} computes attention in its own code (not through transformers' "
                "AttentionInterface or nn.MultiheadAttention): left as written" + (
                    "; its products and softmaxes keep what PyTorch keeps under this policy (the 8-bit policies "
                    "route them)" if routing is not None and "matmul" not in routing.kinds else "") + (
                    "; an F.scaled_dot_product_attention call, if its forward makes one (a diffusers processor's), "
                    "is routed all the same: summary(model, inputs) tells whether one runs and what it keeps"
                    if sdpa_call else "")
            )
        elif (name and name not in skipped and kind_of(module) != "attention" and scores_in_code(module)
              and not any(kind_of(sub) == "attention" for sub in module.modules())
              and not any(name.startswith(f"{outer}.") and {"matmul", "softmax"} & kinds
                          for outer, kinds in watched.items())):
            # (nor one inside an attention whose products and softmaxes are routed, lucidrains' Attend: its calls
            # are that attention's, routed)
            # (a module holding attention of its own, a whole model weighing its outputs by a softmax, is not named)
            skipped[name] = (f"{type(module).__name__} computes a softmax and products of tensors in its own code, "
                             "left as written: slimact routes those (under a policy that compresses them) only in "
                             "attention it recognises, a class whose name says attention (...Attention, ...Attn, MHSA) "
                             "or that calls F.scaled_dot_product_attention")
        elif name not in skipped and isinstance(module.__dict__.get(GATE_ATTR), Gate):
            skipped[name] = (f"no slimact replacement yet for {type(module).__name__} (experts): its forward runs as "
                             "written, its clamped gated unit computed by slimact (kind 'silu', keeping its input "
                             "alone); torch._grouped_mm calls in its code (transformers' default experts "
                             "implementation) are routed where the policy converts 'linear'")
        elif name not in skipped and not any(True for _ in module.children()) and name:
            if _glue(module):
                continue
            kind = kind_of(module)
            if pol is not None and recognise(module).replace is not None and pol.skip_reason(kind, name) is None:
                # (convert converts it or gives a reason: here since, as an adapter added to a converted model)
                skipped[name] = (f"not converted: {type(module).__name__} (kind {kind!r}) came into the model after "
                                 "convert: convert the model again to convert it")
            elif pol is None and isinstance(parent := model.get_submodule(name.rpartition(".")[0]), SlimModule) \
                    and kind_of(parent) == "mlp":
                skipped[name] = _COMPUTED_BY_PARENT  # (convert's reason, held by the model it was converted in)
            elif pol is None and recognise(module).replace is not None:
                # (a model never converted, or reverted: "no slimact replacement yet" had been said of its Linears)
                skipped[name] = (f"not converted: the model was not converted (slimact.convert(model) replaces this "
                                 f"{type(module).__name__}, kind {kind!r})")
            else:
                skipped[name] = f"no slimact replacement yet for {type(module).__name__} (kind {kind!r})"
    if routing is not None and routing.loss is not None:
        modules["(loss)"] = "lmloss"
    result = Summary(
        policy=pol.name if pol else None,
        converted=dict(Counter(modules.values())),
        skipped=skipped,
        modules=modules,
        functional=[k for k in routing.kinds if k != "lmloss"] if routing is not None else [],
    )
    if pol is None and modules:
        names = sorted({m._slimact_policy.name for m in model.modules() if isinstance(m, SlimModule)})
        result.notes.append(
            f"its converted modules ({'/'.join(names)}) were converted as part of another model (a wrapper since "
            "removed: a PeftModel's base after merge_and_unload), which routed the calls in model code and the LM "
            "loss: here they run as written. slimact.convert(model) routes them for this model")
    exact = [name for name, module in model.named_modules() if name in modules
             and any(p.dtype == torch.float64 for p in module.parameters(recurse=False))]
    if exact:
        result.notes.append(
            f"{len(exact)} converted module(s) hold float64 parameters ({', '.join(exact[:3])}"
            f"{', ...' if len(exact) > 3 else ''}): float64 tensors are kept exact, as PyTorch keeps them "
            "(slimact compresses fp32, fp16 and bf16)"
        )
    # One attention module per attention: a child counted for the F.scaled_dot_product_attention call its forward
    # makes, inside an attention module counted itself (OLMo-core's attention backend), is that attention's call
    # (summary said "attention 4" for 2 layers; under "tempo" it demoted the parent and kept the child).
    counted = [name for name, kind in modules.items() if kind == "attention"]
    for name in counted:
        if any(name.startswith(outer + ".") for outer in counted if outer):
            del modules[name]
            by_products.discard(name)  # (the outer's; summary with inputs raised KeyError deleting it again)
            by_sdpa.discard(name)
    if inputs is not None:
        for m in model.modules():
            m.__dict__.pop(GUARDED_ATTR, None)
            m.__dict__.pop(TRANSFORMED_ATTR, None)
        if routing is not None:
            routing.guarded.clear()
        result.coverage, result.uncovered, unrouted, idle, own, as_plain, twice, inside = _coverage(
            model, set(modules), inputs, loss_fn, routing, by_products, by_sdpa)
        guarded = sorted(_guarded(model, routing))
        if guarded:
            result.notes.append(
                f"attention in {', '.join(guarded[:3])}{', ...' if len(guarded) > 3 else ''} kept q, k, v exact on "
                f"these inputs: 8-bit codes of them would put more than {MAX_SCORE_ERROR} logits of estimated error "
                "on its scores (the estimate grows with the score scale times sqrt(D) and the sizes of q and k: "
                "QK-normalised attention with no 1/sqrt(D) exceeds it, and with 1/sqrt(D) comes near it, past it "
                "under stochastic rounding, whose codes err sqrt(2)x more; slimact.functional.attention_guard), so "
                "its attention keeps about what PyTorch's does")
        if twice:
            listed = ", ".join(f"{name} ({n / 2**20:.2f} MiB, kept in full by {full})"
                               for name, (n, full) in sorted(twice.items())[:3])
            result.notes.append(
                f"{len(twice)} converted module(s) keep compressed copies of tensors that are kept in full too (by an "
                "op slimact leaves as written: a product, a pooling, an embedding bag, a sigmoid in model code; by a "
                f"layer the policy keeps exact; or by attention that kept q, k, v exact): {listed}"
                f"{', ...' if len(twice) > 3 else ''}; those copies save nothing (plain PyTorch keeps the one tensor)")
        # (a module in eval mode inside the training model, a BatchNorm frozen for fine-tuning, runs PyTorch's own
        # forward: its bytes are not an op in its code; the note had named soft caps and rotary embeddings for it)
        modes = {name: m.training for name, m in model.named_modules()}
        idle_eval = {name: n for name, n in inside.items() if modes.get(name) is False}
        # (a call under torch.vmap, torch.func.grad or forward-mode AD runs PyTorch's own forward too: a functional
        # ensemble's converted MLP had been reported as keeping tensors through soft caps and rotary products)
        marked = {name for name, m in model.named_modules() if m.__dict__.get(TRANSFORMED_ATTR)}
        stepped = {name: n for name, n in inside.items() if name not in idle_eval and name in marked}
        inside = {name: n for name, n in inside.items() if name not in idle_eval and name not in stepped}
        for found, why in ((inside, "through ops slimact leaves as written in their code (a tanh soft cap or a "
                                    "learned temperature on attention scores, rotary embeddings' products, a mask's "
                                    "multiplication)"),
                           (stepped, "in full where called under a torch.func transform (vmap, grad, jvp), forward-"
                                     "mode AD or a trace, which slimact's Functions do not support: PyTorch's own "
                                     "forward runs there, exact"),
                           (idle_eval, "in full in eval mode inside the training model (a BatchNorm frozen for "
                                       "fine-tuning: PyTorch's own forward runs there)")):
            if found:
                top = sorted(found.items(), key=lambda kv: -kv[1])
                listed = ", ".join(f"{name} ({n / 2**20:.2f} MiB)" for name, n in top[:3])
                result.notes.append(f"{len(found)} converted module(s) keep tensors {why}: {listed}"
                                    f"{', ...' if len(top) > 3 else ''}; counted as not covered")
        for name in as_plain:
            del modules[name]
            if name in guarded:
                skipped[name] = ("its attention kept q, k, v exact for the score guard on these inputs (the note), "
                                 "no fewer bytes than PyTorch's own kernel: not counted as converted")
            elif routing is not None and any(_at_or_under(a, name) for a in routing.attended):  # (or a child's)
                skipped[name] = ("its F.scaled_dot_product_attention calls run through slimact's attention, which "
                                 "keeps no fewer bytes than PyTorch's own kernel on these inputs under this policy: "
                                 "not counted as converted")
            else:  # (DeBERTa's, Reformer's: no SDPA call ran, only their torch.gather calls were routed; a sweep)
                skipped[name] = ("the calls routed in its code on these inputs (torch.gather, kept as its index) keep "
                                 "no fewer bytes than PyTorch does under this policy: not counted as converted")
        for name, why in own.items():
            modules.pop(name, None)
            skipped[name] = f"each call on these inputs ran the module's own forward, left as written: {why}"
        for name in idle:
            del modules[name]
            skipped[name] = ("the LM loss would be fused with the head, but no F.cross_entropy on the head's logits "
                             "that it takes ran in the model's forward on these inputs (a loss computed outside the "
                             "model, no labels, or a loss it computes as written: class weights, reduction='none', "
                             "logits sliced, cast to float64 or changed in place): left as written"
                             if name == "(loss)" else
                             "its attention calls (products and softmaxes, or F.scaled_dot_product_attention) would be "
                             "routed, but none reached slimact in the forward on these inputs (its attention ran "
                             "otherwise, e.g. F.scaled_dot_product_attention with the policy's attention kind off, "
                             "products and softmaxes under a lossless policy, in float64, or of tensors needing no "
                             "gradient): left as written")
        for name in unrouted:
            if routing is not None and any(_at_or_under(r, name) for r in routing.routed):
                continue  # its products and softmaxes (or a child's: DeBERTa-v2's) were routed instead
            del modules[name]
            skipped[name] = ("tagged for slimact's attention, but none of its attention ran through transformers' "
                             "AttentionInterface on these inputs (not called on them, as a vision tower on a text "
                             "batch, or its attention computed otherwise): left as written")
        result.converted = dict(Counter(modules.values()))
    return result


def _guarded(model: nn.Module, routing: Routing | None) -> set[str]:
    """The modules whose attention the score guard kept exact in the last forward (:data:`GUARDED_ATTR`)."""
    return ({name for name, m in model.named_modules() if m.__dict__.get(GUARDED_ATTR)}
            | (routing.guarded if routing is not None else set()))


def _coverage(
    model: nn.Module, converted: set[str], inputs: Any, loss_fn, routing: Routing | None = None,
    by_products: set[str] = frozenset(), by_sdpa: set[str] = frozenset(),
) -> tuple[float, dict[str, int], list[str], list[str], dict[str, str], list[str], dict[str, tuple[int, str]],
           dict[str, int]]:
    """``(share, {module: bytes}, unrouted, idle, own, as_plain, twice, noted)``: the share of the plain model's
    bytes that slimact handles, the bytes it leaves by module, the tagged attention modules whose attention never
    reached slimact, the converted ``nn.MultiheadAttention`` modules each of whose calls ran the module's own forward
    (``{name: why}``: a call slimact's path does not cover, as ``need_weights=True``), and the modules of
    ``by_products`` (reported converted as the routing watches their products and softmaxes, or for the
    F.scaled_dot_product_attention their forward mentions) in which no such call was routed in the forward, with
    ``"(loss)"`` where the routing would fuse the LM loss but none was fused (a loss the training loop computes
    outside the model is never the model's to route: its bytes are not covered), and the modules of ``by_sdpa``
    (reported for an F.scaled_dot_product_attention call in their code, diffusers' Attention's) whose routed calls
    kept no fewer bytes than the plain model's (not covered: counted as left alone), and ``{module: (bytes, full)}``
    of the compressed copies each converted module keeps of tensors that ``full`` keeps in full too
    (:attr:`slimact.Report.twice`), and ``{module: bytes}`` of the converted modules whose own code keeps tensors
    through ops slimact leaves as written (summary's note).

    Bytes slimact's Functions keep inside converted modules (or their children) are covered; what ops left as
    written keep there (:attr:`slimact.Report.as_written`) is not, up to what the plain module kept. A module
    slimact did not convert
    still counts as uncovered with what it keeps in the converted model (measured), at most what it kept in
    the plain one: bytes that routing removed from its own code (functional dropout, activations, the loss)
    are covered, and whatever it still keeps is not, compressed or not.
    """
    from slimact.profile import ROOT, profile

    tagged = {name: m for name, m in model.named_modules() if attention.POLICY_ATTR in m.__dict__}
    for m in tagged.values():
        m.__dict__.pop(attention.SEEN_ATTR, None)
    for m in model.modules():
        m.__dict__.pop(OWN_FORWARD_ATTR, None)
        m.__dict__.pop(SLIM_FORWARD_ATTR, None)
    earlier = set(routing.routed) if routing is not None else set()
    if routing is not None:
        routing.routed.clear()
        routing.attended.clear()
    tracker = routing.loss if routing is not None else None
    fused = tracker.fused if tracker is not None else 0
    # (copied before the step below: a step leaves outputs in hooks and objects of the model that no deep copy
    # takes; fastai's DynamicUnet made summary refuse a model the user had never run)
    plain = _plain_copy(model, "summary")
    try:
        report = profile(model, inputs, loss_fn=loss_fn)
        after = report.by_module
        routed = routing.routed | routing.attended if routing is not None else set()
    finally:
        if routing is not None:
            routing.routed |= earlier
    unrouted = [name for name, m in tagged.items() if not m.__dict__.get(attention.SEEN_ATTR)]
    idle = sorted(name for name in by_products if not any(_at_or_under(r, name) for r in routed))
    if tracker is not None and tracker.fused == fused:
        idle.append("(loss)")
    own = {name: m.__dict__[OWN_FORWARD_ATTR] for name, m in model.named_modules()
           if OWN_FORWARD_ATTR in m.__dict__ and SLIM_FORWARD_ATTR not in m.__dict__}
    converted = converted - set(unrouted) - set(idle) - set(own)
    before = profile(plain, inputs, loss_fn=loss_fn).by_module
    del plain
    # (attention whose q, k, v the score guard kept exact keeps what PyTorch's does: as diffusers' calls that do;
    # a tiny Qwen3 under "mesa" read 99.4% covered keeping its attention's bytes in full, a review)
    guarded = _guarded(model, routing)
    as_plain = sorted(name for name in by_sdpa | guarded
                      if name in converted and after.get(name, 0) >= before.get(name, 0))
    converted = converted - set(as_plain)
    roots = tuple(f"{name}." for name in converted if name and name != "(loss)")

    def covered(name: str) -> bool:
        # ("" is the root in the summary's names, "(model)" in profile's: a converted root covers everything)
        return "" in converted or name in converted or (name + ".").startswith(roots)

    uncovered = {name: min(n, after.get(name, 0)) for name, n in before.items() if not covered(name)}
    # Inside a converted module, what an op slimact leaves as written keeps is not handled either (a tanh soft cap or
    # a learned temperature on attention's scores in model code: its fp32 [T, S] input, 65% of such a module's bytes,
    # had counted as covered), up to what the plain module kept.
    inside = {name: min(n, before.get(name, 0)) for name, n in report.as_written.items() if covered(name)}
    uncovered.update(inside)
    # A converted module all of whose bytes are copies of tensors kept in full (a ReLU's mask under "tempo" before a
    # conv keeping its output) handles nothing of what plain kept: torchvision's ResNet read 46% covered keeping
    # 1.015x plain's bytes (a sweep, 2026-12-07).
    uncovered.update({name: before[name] for name, n in report.twice.items()
                      if covered(name) and name in before and n >= after.get(name, 0)})
    uncovered = {name: n for name, n in uncovered.items() if n}
    total = sum(before.values())
    full = {e.module: e.copy_of for e in report.entries if e.copy_of is not None}
    twice = {name: (n, full[name]) for name, n in report.twice.items()}
    # (the note names the converted modules themselves: a child left alone, a Linear "tempo" skips under converted
    # attention, keeps what it keeps as any module left alone does, a review)
    noted = {name: n for name, n in inside.items() if n and (name in converted or (name == ROOT and "" in converted))}
    return ((1.0 - sum(uncovered.values()) / total if total else 1.0), uncovered, unrouted, idle, own, as_plain,
            twice, noted)
