"""Attention through slimact, and its registration with Hugging Face ``transformers``.

``attention_forward`` has the signature of ``transformers``' attention functions (``AttentionInterface``):

* by default it runs :func:`slimact.functional.scaled_dot_product_attention`, the fused path: ``q``, ``k``,
  ``v`` and the output kept 8-bit per head (exact under a lossless policy) plus the log-sum-exp, never a
  ``[T, S]`` tensor, grouped-query heads never repeated;
* when the caller asks for the probabilities (``output_attentions=True``) of a model that had eager attention
  (SDPA returns none, and so does slimact for a model that had it) it runs the eager path:
  ``q @ k^T`` and ``probs @ v`` through slimact's MatMul, the softmax through slimact's Softmax (the
  probabilities 8-bit per head, kept by the softmax and again by ``probs @ v``, which reads them through a
  grouped view the pack cache does not match), dropout as bits.

``convert`` registers it as ``"slimact"`` (with SDPA-style masks: ``None`` for plain causal attention, a
boolean mask otherwise), selects it on the model's config and tags the model's attention modules; ``revert``
restores the original setting. An untagged module (excluded by the policy, or in a model already reverted
while another model on the same configuration is still converted) and every module in eval mode runs
transformers' own SDPA attention, as a plain model does by default, or, where the configuration had ``"eager"``
attention, the model's own eager attention. Arguments that the fused path does not implement (``softcap``,
attention sinks ``s_aux``/``sinks``) send the call to the model's own eager attention, exact and uncompressed,
and so do the calls of a model that had eager attention whose mask leaves a query row nothing to attend to
(:func:`_as_written_eager`): never a silently different attention.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from slimact.functional._saving import transformed
from slimact.functional.attention import _additive, scaled_dot_product_attention
from slimact.functional.attention_guard import GUARDED_ATTR, guarded
from slimact.functional.dropout import dropout as _dropout
from slimact.functional.matmul import matmul
from slimact.functional.softmax import keep_exact, softmax
from slimact.nn._base import begin_call, site_estimate
from slimact.policy import Policy
from slimact.quant.reference import COMPRESSIBLE_DTYPES

__all__ = [
    "EAGER_NAME", "NAME", "ORIGINAL_ATTR", "POLICY_ATTR", "SEEN_ATTR", "attention_forward", "eager_is_sdpa_with_sinks",
    "register", "registered",
    "release_configs", "setting", "switch_configs",
]

NAME = "slimact"
#: The same attention function with eager attention's masks (always a tensor, additive, the float minimum where
#: masked): selected where a model's own code was written for eager attention alone (``_supports_sdpa = False``) and
#: its attention is SDPA with sinks (:func:`eager_is_sdpa_with_sinks`): DeepSeek V4 extends the mask it is handed with
#: its compressor's additive block bias, which cast into an SDPA-style boolean mask inverts it.
EAGER_NAME = "slimact_eager"
POLICY_ATTR = "_slimact_attention"
#: Probabilities asked for where nothing is compressed: the same eager path, every tensor exact.
_EXACT = Policy(name="exact", quantize=False)
#: Set on a tagged module each time its attention runs here (``summary`` checks the routing took).
SEEN_ATTR = "_slimact_attention_seen"
#: Set by ``convert`` on each module reading a switched configuration: the setting it had (a deep copy of a converted
#: model reads a copy of the configuration, which :func:`setting` does not know).
ORIGINAL_ATTR = "_slimact_attention_original"


def _eager(module, query, key, value, mask, scaling, p, policy, is_causal):
    """Eager attention returning the probabilities, each tensor kept as ``policy`` says: after the dropout, as
    transformers' eager attention functions return them (a loss on them differentiates what the product read)."""
    b, h, t, d = query.shape
    h_kv = key.shape[1]
    cfg = policy.quant_config("attention", 4)
    if cfg is not None and cfg.scale == "running":  # no running state for these tensors: each its own range
        cfg = dataclasses.replace(cfg, scale="dynamic")
    q = query.reshape(b, h_kv, h // h_kv, t, d)  # grouped: keys and values are never repeated
    scores = matmul(q, key.unsqueeze(2).transpose(-1, -2), cfg, cfg).reshape(b, h, t, -1) * scaling
    if mask is not None:
        scores = scores + _additive(mask, scores.dtype)
    elif is_causal:  # top-left aligned, as scaled_dot_product_attention's is_causal
        causal = torch.ones(t, scores.shape[-1], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = softmax(scores.float(), -1, cfg)
    # Returned to the caller (output_attentions): a loss may divide by them (a KL to a teacher's maps), which the
    # softmax's codes cannot serve; held exact for its backward, as plain PyTorch's softmax keeps them
    # (slimact.functional.softmax; the model's outputs are the dropout's, by when the probabilities are gone).
    keep_exact(probs)
    probs = probs.to(query.dtype)
    dropped = _dropout(probs, p, p > 0)
    out = matmul(dropped.reshape(b, h_kv, h // h_kv, t, -1), value.unsqueeze(2), cfg, cfg)
    return out.reshape(b, h, t, -1), dropped


def _probabilities_wanted(kwargs: dict) -> bool:
    """Whether the caller collects attention probabilities (``output_attentions=True``).

    Some models (GPT-2) drop the flag before calling the attention function; transformers then collects the
    probabilities through a context variable, which is consulted too.
    """
    if kwargs.get("output_attentions", False):
        return True
    if torch.compiler.is_compiling():  # dynamo cannot read the context variable (a graph break): as SDPA, None
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers version: the flag above is all there is
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


#: Keyword arguments of transformers' attention calls that change what attention computes and that the fused
#: path does not implement: such a call runs the model's own eager attention.
_EAGER_ONLY = ("softcap",)
#: Attention sinks as transformers' attention calls pass them (gpt-oss's ``s_aux=self.sinks``): the fused path
#: takes the module's own ``sinks`` parameter, one logit per query head; any other value runs the model's eager
#: attention (Inkling 2 computes its ``sinks`` per query).
_SINKS = ("s_aux", "sinks")
#: Keyword arguments that only a kernel other than eager or SDPA consumes, which model code passes where the setting
#: is neither (DeepSeek V3.2's ``indices``: its top-k keys, folded into the mask for eager and SDPA, which slimact's
#: setting reads as): given one, no mask holds what it says, and neither path can compute what the model asked.
_KERNEL_ONLY = ("indices",)


def _additive_mask(mask: Tensor | None, is_causal: bool, query: Tensor, key: Tensor) -> Tensor | None:
    """An SDPA-style mask (``None`` for causal or none, boolean, or additive) as the additive mask eager
    attention adds to its scores: 0 where allowed, the dtype's minimum elsewhere, as transformers' ``eager_mask``
    builds it (not -inf: a fully masked row is then uniform, as the plain eager model has it, not NaN)."""
    if mask is None and is_causal:
        t, s = query.shape[2], key.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril()[None, None]
    if mask is None or mask.dtype != torch.bool:
        return mask if mask is None else mask.to(query.dtype)
    zero = torch.zeros((), dtype=query.dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(query.dtype).min)


def _model_eager(module: nn.Module, query, key, value, mask, scaling, p, is_causal, kwargs):
    """The module's own modeling file's ``eager_attention_forward`` (exact, nothing compressed)."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        used = [k for k in _EAGER_ONLY if kwargs.get(k) is not None]
        raise NotImplementedError(
            f"slimact's attention does not implement {used} and {type(module).__module__} has no "
            "eager_attention_forward to run instead: exclude this module from conversion "
            "(filter_fn, or a policy with attention off)"
        )
    return eager(module, query, key, value, _additive_mask(mask, is_causal, query, key), scaling=scaling,
                 dropout=p, **kwargs)


def _own_sinks(module: nn.Module, given: Tensor, query: Tensor) -> bool:
    """Whether attention sinks ``given`` to an attention call are the module's own ``sinks`` parameter, one logit
    per query head: what a model's eager attention reads (gpt-oss's reads ``module.sinks`` whatever the call passes)
    and what the fused path takes."""
    return (given is getattr(module, "sinks", None) and given.dim() == 1 and given.shape[0] == query.shape[1]
            and given.is_floating_point())


#: The parameters of an eager attention function that :func:`eager_is_sdpa_with_sinks` probes: any other named one
#: (Inkling 2's ``position_bias``) is an input the probe does not give, whose effect it cannot see.
_EAGER_PARAMETERS = ("module", "query", "key", "value", "attention_mask", "scaling", "dropout")


def eager_is_sdpa_with_sinks(module: nn.Module) -> bool:
    """Whether ``module``'s model, which declares ``_supports_sdpa = False``, has an eager attention that computes
    scaled dot-product attention with the module's attention sinks and nothing else (gpt-oss, Granite SWA, Flint,
    the OpenAI privacy filter, Hunyuan V4, DeepSeek V4, MiMo V2 Flash): then slimact's fused path, which takes sinks,
    computes it. A module whose ``sinks`` attribute is ``None`` (MiMo's layers without) is probed without.

    Decided by running it: the modeling file's ``eager_attention_forward`` on random fp32 inputs (2 sequences of 5
    tokens, a causal mask hiding one padded key of the first, as transformers' eager masks are built: the float
    minimum) against :func:`slimact.functional.attention._attention` with the module's ``sinks``, to fp32 rounding
    (a softcap, another sink formula, anything more differs by orders more). Not where the function takes an
    argument the probe does not give (``_EAGER_PARAMETERS``), or the module has no ``sinks`` attribute, or sinks
    other than one logit per head.
    """
    import inspect

    from slimact.functional.attention import _attention

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None or not hasattr(module, "sinks"):
        return False
    sinks = module.sinks
    groups = getattr(module, "num_key_value_groups", None)
    d_qk = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)  # (MLA: q, k wider than v)
    d_v = getattr(module, "v_head_dim", None) or getattr(module, "head_dim", None)
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or not sinks.is_floating_point():
            return False
        heads = sinks.shape[0]
    if not all(isinstance(x, int) and x > 0 for x in (groups, d_qk, d_v, heads)) or heads % groups:
        return False
    try:
        params = inspect.signature(eager).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.name not in _EAGER_PARAMETERS for p in params if p.kind is not p.VAR_KEYWORD):
        return False
    device = next(module.parameters(), torch.empty(0)).device
    b, t, gen = 2, 5, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=gen).to(device)
               for n, d in ((heads, d_qk), (heads // groups, d_qk), (heads // groups, d_v)))
    allowed = torch.ones(t, t, dtype=torch.bool, device=device).tril().repeat(b, 1, 1, 1)  # [B, 1, T, T]
    allowed[0, ..., 1] = False  # (a padded key; every row keeps key 0)
    additive = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    scaling = float(getattr(module, "scaling", d_qk**-0.5))
    try:
        with torch.no_grad():
            out = eager(module, q, k, v, additive, scaling=scaling, dropout=0.0, s_aux=sinks)[0]
            expected = _attention(q, k, v, allowed, 0.0, False, scaling, True,
                                  None if sinks is None else sinks.detach().float())
    except Exception:  # (anything it cannot run is not what slimact computes)
        return False
    return out.shape == expected.transpose(1, 2).shape and torch.allclose(
        out.float(), expected.transpose(1, 2), rtol=1e-4, atol=1e-5)


class _Switched(str):
    """``"slimact"`` as ``convert`` selects it on a configuration, carrying the setting the configuration had: a copy
    of the configuration (``copy.deepcopy``, a model built from it with ``from_config``) reads that setting too.

    It also equals ``"sdpa"``: model code that branches on the setting's name takes SDPA's branch, the one written for
    a function that takes SDPA's masks and arguments, as slimact's does. DeepSeek V3.2's sparse attention (and GLM-MoE-
    DSA's, Mistral Large 4's, ...) folds its indexer's top-k keys into the mask for ``"eager"`` and ``"sdpa"`` alone,
    and hands any other function the indices instead (for flash-MLA to consume); Gemma 4 slices the queries of its
    KV-shared layers unless the setting is flash, flex or ``"sdpa"``. Under the name alone a converted model attended
    to every key there, forward and backward, silently. ``!=`` stays the names' inequality: a check that refuses what
    is not ``"sdpa"`` (the Trainer's context parallelism, which patches PyTorch's SDPA) still refuses slimact, and
    ``set_attn_implementation("sdpa")`` still switches a converted model to PyTorch's SDPA."""

    original: Any
    #: its own name, then the setting whose branch model code takes
    _names = (NAME, "sdpa")

    def __new__(cls, original: Any) -> _Switched:
        self = super().__new__(cls, cls._names[0])
        self.original = original
        return self

    def __eq__(self, other: object) -> bool:  # (plain strings compared: what dynamo traces without a graph break)
        return isinstance(other, str) and other in self._names

    def __hash__(self) -> int:  # (a dict of implementations finds "slimact"'s entry; str's C slot breaks dynamo)
        return hash(self._names[0])

    def __getnewargs__(self) -> tuple[Any]:  # (copies and pickles)
        return (self.original,)


class _SwitchedEager(_Switched):
    """:data:`EAGER_NAME` as ``convert`` selects it: model code written for eager attention alone sees ``"eager"``
    (its own branch) and eager attention's masks."""

    _names = (EAGER_NAME, "eager")


def _ours(value: Any) -> bool:
    """Whether an attention setting is one ``convert`` selects."""
    return isinstance(value, _Switched) or value in (NAME, EAGER_NAME)


def setting(config: Any) -> Any:
    """``config``'s attention implementation as the user chose it: the one it had before ``convert`` selected
    ``"slimact"`` on it (on it or on the configuration it is a copy of), else its present one."""
    if config is None:
        return None
    present = _setting(config)
    entry = _SWITCHED.get(id(config))
    if entry is not None and entry.ref() is config and _ours(present):
        return entry.original
    # (else another one chosen since, set_attn_implementation: that one)
    return present.original if isinstance(present, _Switched) else present


def registered(name: Any) -> Any:
    """The function a model's attention finds under ``name`` (``None``: none, as for ``"eager"``, which runs the
    model's own ``eager_attention_forward``): ``ALL_ATTENTION_FUNCTIONS``, the interface the modeling files read,
    whose own entries (``ALL_ATTENTION_FUNCTIONS["sdpa"] = fn``) override ``AttentionInterface.register``'s."""
    from transformers import AttentionInterface

    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # (another transformers version: the class-wide mapping alone)
        return getattr(AttentionInterface, "_global_mapping", {}).get(name)
    return ALL_ATTENTION_FUNCTIONS.get(name)


def _chosen(module: nn.Module) -> Any:
    """The attention setting ``module``'s configuration had before ``convert`` selected ``"slimact"``."""
    chosen = setting(getattr(module, "config", None))
    return module.__dict__.get(ORIGINAL_ATTR, chosen) if _ours(chosen) else chosen


def _as_written_eager(module: nn.Module, policy: Policy | None, mask: Tensor | None) -> bool:
    """Whether a call of a model that had ``"eager"`` attention runs its own eager attention, exact and
    uncompressed: in eval mode and in modules left alone (as the plain model computes it), and in training where the
    mask leaves a query row nothing to attend to. There eager attention gives the row the mean of the values over
    every key (the scores plus the mask's float minimum round to that minimum: uniform probabilities) and its
    autograd passes the softmax's gradient on to q and k, where SDPA, and slimact's fused path, give 0 and no
    gradient: a loss over padded positions, the output at them, or their probabilities would differ from the plain
    model's. Other rows are the same up to float rounding."""
    if _chosen(module) != "eager":
        return False
    if getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) is None:
        return False  # (no eager function to run: as before, the fused path)
    if policy is None:
        return True
    return mask is not None and mask.dtype == torch.bool and bool((~mask.any(-1)).any())


class _Switch(NamedTuple):
    ref: weakref.ref
    original: Any
    users: weakref.WeakSet


#: Configuration objects switched to ``"slimact"``: id -> (the object, its setting before any model switched
#: it, the converted models using it). Two models may share one configuration: the last to revert restores it.
_SWITCHED: dict[int, _Switch] = {}


def _setting(config: Any) -> Any:
    return config.__dict__.get("_attn_implementation_internal", getattr(config, "_attn_implementation", None))


def _set(config: Any, value: Any) -> None:
    # The internal field, not the property: the property also overwrites every sub-configuration.
    if "_attn_implementation_internal" in config.__dict__:
        config.__dict__["_attn_implementation_internal"] = value
    else:
        config._attn_implementation = value


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _SWITCHED.get(key)
    if entry is not None and entry.ref is ref:
        del _SWITCHED[key]


def switch_configs(model: nn.Module, configs: list[Any], eager_masks: set[int] = frozenset()) -> list[tuple[Any, Any]]:
    """Select ``"slimact"`` on each of ``configs`` for ``model`` (:data:`EAGER_NAME` on those whose ``id`` is in
    ``eager_masks``); returns ``[(config, original)]`` for :func:`release_configs`."""
    records = []
    for config in {id(c): c for c in configs}.values():
        key = id(config)
        entry = _SWITCHED.get(key)
        if entry is None or entry.ref() is not config:
            ref = weakref.ref(config, lambda r, key=key: _forget(key, r))
            entry = _SWITCHED[key] = _Switch(ref, setting(config), weakref.WeakSet())
        elif not _ours(_setting(config)):  # a setting chosen since it was switched (set_attn_implementation): that one
            entry = _SWITCHED[key] = entry._replace(original=_setting(config))
        entry.users.add(model)
        _set(config, (_SwitchedEager if key in eager_masks else _Switched)(entry.original))
        records.append((config, entry.original))
    return records


def release_configs(model: nn.Module, records: list[tuple[Any, Any]]) -> None:
    """Undo :func:`switch_configs` for ``model``: a configuration no other converted model uses gets its
    original setting back (a copy of a converted model, unknown here, restores the one it recorded)."""
    for config, original in records:
        entry = _SWITCHED.get(id(config))
        if entry is not None and entry.ref() is config:
            entry.users.discard(model)
            if len(entry.users):
                continue
            del _SWITCHED[id(config)]
            original = entry.original
        if _ours(_setting(config)):  # (else a setting chosen since, set_attn_implementation: the user's, kept)
            _set(config, original)


def _documents(module: nn.Module, query: Tensor, key: Tensor, mask: Tensor | None, is_causal: bool | None,
               kwargs: dict) -> Tensor | None:
    """Where the configuration had flash attention and the call carries packed documents as flash attention reads
    them (its varlen arguments ``cu_seq_lens_q``/``cu_seq_lens_k``, as ``DataCollatorWithFlattening`` gives them, or
    one row of ``position_ids`` that restart), the boolean mask they stand for: each query attends to keys of its own
    document only (causally aligned at the documents' ends, as the varlen kernel has it), where ``mask`` allows.
    ``None`` otherwise: SDPA, eager and flex attention read the documents from the mask transformers builds, which
    has none where a cache is used (a training forward with ``use_cache`` on). ``None`` too where ``mask`` hides a
    padded key (a key no query of its row may read): flash attention is then given the padding mask, unpads by it
    and reads no documents (transformers' ``_flash_attention_forward``); and where the varlen arguments come without
    ``max_length_q``/``max_length_k``, which flash attention's varlen call needs (it reads ``position_ids`` then)."""
    if not str(_chosen(module)).startswith("flash_"):
        return None
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        if not bool(allowed[..., : key.shape[-2]].any(-2).all()):
            return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if any(kwargs.get(k) is None for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")):
        # (as transformers' flash attention reads position_ids: _is_packed_sequence)
        pos = kwargs.get("position_ids")
        if pos is None or query.shape[0] != 1 or pos.shape[-1] == 1:
            return None
        pos = pos.reshape(-1)
        if torch.equal(pos, torch.arange(pos.numel(), device=pos.device) + pos.min()):
            return None  # one document
        cu_q = cu_k = torch.cat([(pos == pos.min()).nonzero().view(-1), pos.new_tensor([pos.numel()])])

    def place(cu: Tensor, batch: int, length: int) -> tuple[Tensor, Tensor]:  # (document, tokens left in it)
        flat = torch.arange(batch * length, device=query.device)
        ends = cu[1:].to(query.device)
        doc = torch.bucketize(flat, ends, right=True).clamp_(max=ends.numel() - 1)
        return doc.view(batch, length), (ends[doc] - flat).view(batch, length)

    (doc_q, left_q), (doc_k, left_k) = place(cu_q, *query.shape[:3:2]), place(cu_k, *key.shape[:3:2])
    allowed = doc_q[:, None, :, None] == doc_k[:, None, None, :]
    if is_causal if is_causal is not None else getattr(module, "is_causal", True):
        allowed &= left_k[:, None, None, :] >= left_q[:, None, :, None]
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return allowed & mask[..., : key.shape[-2]]
    return mask[..., : key.shape[-2]].masked_fill(~allowed, torch.finfo(mask.dtype).min)


def _seen_keys(query: Tensor, key: Tensor, value: Tensor,
               position_bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``key``, ``value`` (and ``position_bias``) of causal attention without a mask, more keys than queries, cut to
    the keys a query can see, as transformers' SDPA integration cuts them: such attention is top-left aligned (SDPA's
    ``is_causal``), query ``i`` reads keys ``0..i``, so no query reads a key past the ``T``-th, and the output and every
    gradient are the same, exactly (those keys' gradient is 0); what is kept, and its dropout draws, are the plain
    model's.

    A call gets such keys where a user's own non-reentrant ``torch.utils.checkpoint`` around a decoder layer run with
    ``use_cache=True`` (mask ``None``: no prefix, no padding) recomputes the layer: the cache the forward filled hands
    the recompute the forward's keys and its own, twice as many. Kept whole, the keys slimact saved differed in shape
    from the forward's, which the checkpoint refused (``CheckpointError``) where the plain model trained; cut, the
    recompute keeps the forward's very keys, and the gradients are those without the checkpoint. (And an empty
    ``StaticCache``'s prefill, whose keys are the cache's length.)"""
    t = query.shape[2]
    if position_bias is not None:
        position_bias = position_bias[..., :t]
    seen = key[:, :, :t]
    return seen, seen if value is key else value[:, :, :t], position_bias  # (keys that are the values: one pack)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """``[B, H, T, D]`` query, ``[B, H_kv, S, D]`` key and value -> (``[B, T, H, D]`` output, probabilities or None)."""
    policy: Policy | None = module.__dict__.get(POLICY_ATTR)
    if policy is not None:
        module.__dict__[SEEN_ATTR] = True
        if (not module.training or not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                                                      or value.requires_grad))
                or query.dtype not in COMPRESSIBLE_DTYPES or transformed()):
            # eval mode, no gradient to flow (no_grad: generate() on a model in train mode), float64, a torch.func
            # transform: the attention the model had, as written, nothing packed (an eager model's logits were
            # slimact's fused path's, 1.5e-7 off, under no_grad)
            policy = None
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    p = dropout if module.training else 0.0
    if given := [k for k in _KERNEL_ONLY if kwargs.get(k) is not None]:
        raise NotImplementedError(
            f"{type(module).__name__} passed {given} to its attention function: arguments only a kernel other than "
            "eager or SDPA consumes (its model code did not fold them into the mask), which slimact's attention "
            "cannot honour: exclude this module from conversion (filter_fn, or a policy with attention off)"
        )
    if (documents := _documents(module, query, key, attention_mask, is_causal, kwargs)) is not None:
        attention_mask, is_causal = documents, False
    # Probabilities asked for (output_attentions=True) are returned only where the model had eager attention: SDPA
    # (and flash, flex) return none, as slimact's fused path then does (its eager path, taken for them, gave rows a
    # mask leaves nothing to attend to NaN, where SDPA gives 0: a left-padded batch's loss and every gradient NaN).
    wanted = _probabilities_wanted(kwargs) and _chosen(module) == "eager"
    given = [kwargs[k] for k in _SINKS if kwargs.get(k) is not None]
    sinks = given[0] if len(given) == 1 and _own_sinks(module, given[0], query) else None
    if (any(kwargs.get(k) is not None for k in _EAGER_ONLY) or _as_written_eager(module, policy, attention_mask)
            or (given and (sinks is None or policy is None or wanted))):
        causal = bool(query.shape[2] > 1 and attention_mask is None
                      and (is_causal if is_causal is not None else getattr(module, "is_causal", True)))
        return _model_eager(module, query, key, value, attention_mask, scaling, p, causal, kwargs)
    if policy is None and not wanted:  # as a plain model with SDPA attention computes it
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=p, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, **kwargs)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[..., : key.shape[-2]]
    # As transformers' SDPA integration: causal only when no mask stands for it and there is more than one query.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > query.shape[2] and not wanted:  # (probabilities keep the keys' width)
        key, value, position_bias = _seen_keys(query, key, value, position_bias)
    if position_bias is not None:  # T5's learned relative bias: one additive mask, as transformers' SDPA builds it
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    if wanted:  # exact (lossless) in eval mode or for modules left alone
        out, probs = _eager(module, query, key, value, attention_mask, scaling, p, policy or _EXACT, is_causal)
        return out.transpose(1, 2).contiguous(), probs
    state = None
    if policy.settings("attention").scale == "running":
        begin_call(module)  # (a module called several times per pass: one estimate per call)
        state = {n: site_estimate(module, n) for n in ("q", "k", "v", "o")}
    out, tripped = guarded(scaled_dot_product_attention, query, key, value, attn_mask=attention_mask, dropout_p=p,
                           is_causal=is_causal, scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
                           cfg=policy.quant_config("attention", 4), state=state, sinks=sinks)
    if tripped:  # (q, k, v kept exact for the score error guard: summary(model, inputs) says so)
        module.__dict__[GUARDED_ATTR] = True
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"slimact"`` with ``transformers`` (attention function and SDPA-style masks), and
    :data:`EAGER_NAME` (the same function, eager attention's masks). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for name, masks in ((NAME, "sdpa"), (EAGER_NAME, "eager")):
        AttentionInterface.register(name, attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[masks])
