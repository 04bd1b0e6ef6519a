"""What a module computes, decided once: the recogniser ``convert``, ``summary`` and ``profile`` share.

:func:`recognise` runs one ordered table of rules (:data:`_RULES`) over a module and returns a
:class:`Recognised`: its op kind (``"linear"``, ``"layernorm"``, ``"attention"``, ... or ``"other"``), which
slimact replacement computes it (``None`` for a kind slimact only reports), that replacement's settings
(an activation's form, a norm's eps), why a known kind is left alone, and the children the replacement
computes itself. ``kind_of`` is its ``kind``; ``convert`` maps ``replace`` to a class.

Two rules keep the recognition honest:

* **A subclass whose forward is its own is not its base class.** A torch layer is replaced only when its
  class runs the torch base class's own ``forward`` (a parametrised or renamed subclass does); one that
  overrides ``forward`` (timm's ``LayerNorm2d`` permutes NCHW inside it, ``BatchNormAct2d`` applies an
  activation after it, ``SyncBatchNorm`` reduces across ranks) is left alone with the reason, unless its
  math is checked on a probe, as norms, activations and gated MLPs are.
* **Recognised by what it computes.** Norms, activations and gated MLPs of model-specific classes
  (Hugging Face's ``LlamaRMSNorm``, ``NewGELUActivation``, ``LlamaMLP``, a user's ``Swish``) are run on a
  probe on their own device and in their own parameters' dtype and compared with the known forms, within
  that dtype's rounding. A probe that cannot run on a plain ``[..., C]`` tensor (a ``TypeError`` or
  ``RuntimeError``-like failure of the module's own forward) means "not this form"; anything else is a bug
  and propagates.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import itertools
import numbers
import os
import re
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module
from torch.nn.utils import parametrize

from slimact.functional._saving import foreign_weight, observer
from slimact.quant.recompute import unseen_by_selective_checkpointing

__all__ = [
    "GATED_MLP_PARTS",
    "GatedLayout",
    "Probed",
    "Recognised",
    "activation_form",
    "as_probed",
    "changed_since",
    "foreign_linear_weight",
    "forget",
    "forward_names",
    "gated_layout",
    "gated_mlp_form",
    "gated_mlp_intact",
    "kind_of",
    "named_norm",
    "norm_eps",
    "norm_form",
    "probed_state",
    "recognise",
    "scores_in_code",
    "uses_attention_interface",
    "written_in_model_code",
]


@dataclass(frozen=True)
class Recognised:
    """What :func:`recognise` found. ``replace`` names the slimact replacement (``None``: report only)."""

    kind: str
    replace: str | None = None
    extra: dict = field(default_factory=dict)
    reason: str | None = None
    #: Children (attribute names) that the replacement computes itself (a gated MLP's down projection).
    parts: tuple[str, ...] = ()


#: Failures of a module's own forward on a probe that mean "not this form" (wrong rank, arguments, dtype; an optional
#: argument the probe does not pass, which the forward needs: LaraMini's gated RMSNorm reads `gate.to(...)`, Zamba2's
#: gated MLP looks its per-layer adapter up by `layer_idx`, a KeyError for None; an assert on the input's rank:
#: xLSTM's MultiHeadLayerNorm, `assert input.dim() == 4`, made convert and even profile of the plain model raise).
_PROBE_ERRORS = (TypeError, ValueError, RuntimeError, LookupError, NotImplementedError, AttributeError, AssertionError)

#: Hugging Face's names for a gated MLP's parts: separate gate and up (Llama, Mistral, Qwen2, Gemma) or one
#: fused ``gate_up_proj`` (Phi-3); the down projection; the activation module.
GATED_MLP_PARTS = {"gate": "gate_proj", "up": "up_proj", "gate_up": "gate_up_proj", "down": "down_proj",
                   "act": ("act_fn", "activation_fn")}
#: The smooth forms a fused gated MLP differentiates, and the torch function a forward calls for each where its
#: activation is a call, not a module (``F.silu(self.w1(x)) * self.w3(x)``: Meta's Llama, torchtitan, gpt-fast,
#: LitGPT); quick GELU has none (``x * torch.sigmoid(1.702 * x)``, its formula).
_GATED_CALLS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
                "gelu_tanh": functools.partial(nn.functional.gelu, approximate="tanh"), "quick_gelu": None}


@dataclass(frozen=True)
class GatedLayout:
    """Where a gated MLP ``down(act(gate(x)) * up(x))`` holds its parts: attribute names of its child modules.

    Either ``gate`` and ``up`` (two Linears) or ``gate_up`` (one Linear computing both: ``[gate | up]`` along the
    last dim, ``[up | gate]`` where not ``gate_first``); ``act`` names the activation module, or is ``None``
    where the forward calls the form's function itself."""

    down: str
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None
    gate_first: bool = True
    act: str | None = None

    def parts(self, module: nn.Module) -> tuple[nn.Module | None, ...]:
        """``(gate_up, gate, up, down, act)`` of ``module``, ``None`` where this layout has none (read from
        ``_modules``: a converted block reads its parts on every call, and ``getattr`` of a missing name raises
        inside ``nn.Module.__getattr__``, a few microseconds each)."""
        get = module._modules.get
        return tuple(None if n is None else get(n) for n in (self.gate_up, self.gate, self.up, self.down, self.act))

    def split(self, gate_up: Tensor) -> tuple[Tensor, Tensor]:
        """``(gate, up)``: the two halves of the fused projection's ``[..., 2F]`` output (or of its gradient)."""
        first, second = gate_up.chunk(2, dim=-1)
        return (first, second) if self.gate_first else (second, first)

    @property
    def computed(self) -> tuple[str, ...]:
        """The children the fused block computes itself (it calls only the gate and up projections)."""
        return (self.down,) if self.act is None else (self.down, self.act)


_FORM_KIND = {"gelu": "gelu", "gelu_tanh": "gelu", "quick_gelu": "gelu", "silu": "silu", "relu": "relu",
              "relu2": "relu"}
_ACTIVATION_NAME = re.compile(r"gelu|silu|swish|relu|act", re.IGNORECASE)
#: An activation's probe: [-8, 8] finely, and far out, where a clipped form departs (transformers' ``gelu_10``, a GELU
#: clipped to [-10, 10], is GELU on [-8, 8]).
_PROBE = torch.cat([torch.linspace(-8.0, 8.0, 321), torch.tensor([-1e4, -100.0, -20.0, -12.0, 12.0, 20.0, 100.0, 1e4])])
_cache: weakref.WeakKeyDictionary[nn.Module, Recognised] = weakref.WeakKeyDictionary()


def _cls(module: nn.Module) -> type[nn.Module]:
    """The module's own class (the original one if slimact converted it, or if it was made by calling the class of a
    module slimact converted: :func:`slimact.nn._base.original_class`)."""
    from slimact.nn._base import SlimModule, original_class

    return original_class(module) if isinstance(module, SlimModule) else type(module)


def _torch_base(cls: type) -> type | None:
    """The nearest class of ``torch.nn`` itself in ``cls``'s hierarchy."""
    return next((c for c in cls.__mro__ if c.__module__.startswith("torch.nn.modules.")), None)


#: Where ``torch.nn``'s module classes are defined: their own forwards' code is there.
_TORCH_MODULES_DIR = os.path.dirname(nn.modules.__file__)


def _own_forward(cls: type, base: type | None = None) -> str | None:
    """Why ``cls`` cannot be taken for ``base`` (default: its torch base class): it defines a forward of its own, or
    the torch class's forward is not PyTorch's (patched on the class: ``nn.LayerNorm.forward = ...``)."""
    base = base or _torch_base(cls)
    if base is None:
        return None
    if cls.forward is base.forward:
        # (a patch on torch's class had been taken for torch's own forward: the replacement computed unpatched math, a
        # LayerNorm's output halved by the patch doubled, a sweep)
        code = getattr(base.forward, "__code__", None)
        if not base.__module__.startswith("torch.") or (code is not None
                                                        and code.co_filename.startswith(_TORCH_MODULES_DIR)):
            return None
        return (f"nn.{base.__name__}.forward is not PyTorch's own (patched, from "
                f"{getattr(base.forward, '__module__', None) or 'elsewhere'}): slimact's {base.__name__} would not "
                "compute what it does")
    owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)
    where = "nn." if base.__module__.startswith("torch.") else f"{base.__module__}."
    return (f"{cls.__name__} subclasses {where}{base.__name__} with its own forward ({owner.__qualname__}.forward): "
            f"slimact's {base.__name__} would not compute what it does")


def _tolerance(dtype: torch.dtype) -> float:
    """Relative agreement that counts as "the same form" for a probe computed in ``dtype``."""
    return max(1e-4, 4 * torch.finfo(dtype).eps)


def _params_of(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of the module's own parameters (CPU fp32 for a parameter-free module)."""
    p = next((p for p in module.parameters() if p.is_floating_point()), None)
    return (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)


def _library_base(cls: type, name: str, package: str) -> type | None:
    """The class named ``name`` of library ``package`` in ``cls``'s hierarchy (matched by name: slimact imports no
    library to recognise its layers)."""
    return next((c for c in cls.__mro__ if c.__name__ == name and c.__module__.startswith(package)), None)


_HF_CONV1D = ("Conv1D", "transformers.")
#: PyTorch Geometric's ``Linear`` (its convs' projections: GCN, GAT, SAGE, TransformerConv, its MLP): a module whose
#: forward is ``F.linear(x, self.weight, self.bias)``, weight ``[out, in]``.
_PYG_LINEAR = ("Linear", "torch_geometric.nn.dense.linear")


def _runs_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its class's forward: hooks of someone else's (its own or global
    forward/backward hooks; slimact's routing hooks aside), or a ``forward`` set on the instance (accelerate's
    ``add_hook_to_module``, which moves offloaded weights in). A replacement that uses its weights without calling
    it would skip them."""
    tables = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks,
              _torch_module._global_forward_pre_hooks, _torch_module._global_forward_hooks,
              _torch_module._global_backward_pre_hooks, _torch_module._global_backward_hooks)
    return "forward" in module.__dict__ or any(_foreign(h) for table in tables if table for h in table.values())


def _foreign(hook: Callable) -> bool:
    """Whether a hook is not slimact's own (its routing's bound methods and partials of them)."""
    # (Attributes read where they are, not through getattr with a default: a miss costs about a microsecond, and a
    # converted gated MLP checks its parts' hooks on every call.)
    fn = hook.func if isinstance(hook, functools.partial) else hook
    fn = fn.__func__ if isinstance(fn, types.MethodType) else fn
    where = fn.__module__ if isinstance(fn, types.FunctionType) else type(fn).__module__
    return not (where or "").startswith("slimact.")


def forward_names(module: nn.Module, through_super: bool = False) -> tuple[str, ...]:
    """The global and attribute names the module's own ``forward`` mentions (decorators unwrapped); with
    ``through_super``, also those of each base class's ``forward`` it reaches through ``super().forward`` (a
    subclass of ``nn.GroupNorm`` left alone whose forward returns ``super().forward(x) * s`` runs
    ``nn.GroupNorm.forward``'s ``F.group_norm``)."""
    cls: type | None = _cls(module)
    names: tuple[str, ...] = ()
    while cls is not None:
        forward = getattr(cls, "forward", None)
        code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
        own = code.co_names if code is not None else ()
        names += own
        if not through_super or "super" not in own:
            break
        mro = cls.__mro__  # the next class defining a forward after the one that defined this one
        at = next(i for i, c in enumerate(mro) if "forward" in c.__dict__)
        cls = next((c for c in mro[at + 1:] if "forward" in c.__dict__), None)
    return names


def uses_attention_interface(module: nn.Module) -> bool:
    """Whether the module's forward calls transformers' ``AttentionInterface`` (``ALL_ATTENTION_FUNCTIONS``).

    Only such a module computes its attention with the function the config selects: others (Falcon's, which
    tests ``config._attn_implementation == "sdpa"`` and else writes its own scores) would change what they
    compute if the setting changed under them.
    """
    return "ALL_ATTENTION_FUNCTIONS" in forward_names(module)


# ---------------------------------------------------------------------------------------------- activations


def _looks_like_activation(module: nn.Module) -> bool:
    cls = _cls(module)
    if next(module.children(), None) is not None or next(module.parameters(), None) is not None:
        return False
    if next(module.buffers(), None) is not None:
        return False
    return (
        cls.__module__.startswith(("torch.nn.modules.activation", "transformers.activations"))
        or bool(_ACTIVATION_NAME.search(cls.__name__))
    )


@contextlib.contextmanager
def _probing_grad() -> Iterator[None]:
    """Grad mode for a probe (``convert`` may run under ``no_grad``), out of sight of what runs around it: a
    profiler's saved-tensor hooks (a module first recognised during a profiled forward) and TorchFunctionModes
    (slimact's routing, which would compute the probe's activation with its own Functions)."""
    with (torch.inference_mode(False), torch.enable_grad(), torch._C.DisableTorchFunction(),
          torch.autograd.graph.saved_tensors_hooks(_kept_as_is, _kept_as_is)):
        yield


@observer
def _kept_as_is(t: Tensor) -> Tensor:
    return t


#: The parameters of the model ``convert`` recognises modules in (:func:`recognising`): a frozen one a module's code
#: reads from outside it counts as such a tensor too (frozen at convert, trained later).
class _ModelParams(threading.local):
    params: list[nn.Parameter] = []  # noqa: RUF012 (each thread's own, set by recognising)


_MODEL_PARAMS = _ModelParams()


@contextlib.contextmanager
def recognising(model: nn.Module) -> Iterator[None]:
    """Recognition of ``model``'s modules (``convert``): :func:`_reads_other_gradients` sees its frozen parameters as
    trainable ones (a model frozen, converted, then unfrozen: a Swish reading its parent's ``beta`` had been replaced,
    and ``beta.grad`` stayed None where plain's is -1.22; a review)."""
    before = _MODEL_PARAMS.params
    _MODEL_PARAMS.params = [p for p in model.parameters() if p.is_floating_point()]
    try:
        yield
    finally:
        _MODEL_PARAMS.params = before


def _reads_other_gradients(module: nn.Module, x: Tensor) -> bool:
    """Whether ``module``'s training forward of ``x`` (needing no gradient) returns a tensor that needs one with the
    module's own parameters frozen and the rest of the model's trainable (:func:`recognising`): its code reads a
    tensor held elsewhere that requires grad or may (a parent's parameter through a closure or a getter: a learnable
    Swish ``beta``, a gain the parent holds). slimact's replacement of a recognised module differentiates its input
    and its own weights only: that tensor would get no gradient, and never train (found by a review: ``.grad`` None
    where plain's is -0.56)."""
    own = list(module.parameters())
    mine = {id(p) for p in own}
    frozen = [p for p in own if p.requires_grad]
    thawed = [p for p in _MODEL_PARAMS.params if not p.requires_grad and id(p) not in mine]
    try:
        for p in frozen:
            p.requires_grad_(False)
        for p in thawed:
            p.requires_grad_(True)
        with _probing_grad(), _training(module):
            y = _cls(module).forward(module, x.detach().clone())  # (a copy: an in-place activation writes into it)
    except _PROBE_ERRORS:
        return False
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for p in thawed:
            p.requires_grad_(False)
    return any(t.requires_grad for t in (y if isinstance(y, (tuple, list)) else (y,)) if isinstance(t, Tensor))


def _reads_other_reason(cls: type, what: str) -> str:
    """Why a module recognised by a probe is left as written where :func:`_reads_other_gradients`."""
    return (f"{cls.__name__} computes {what} on a probe, but its forward also reads a tensor that needs a gradient "
            "and is not its own parameter (a parent's, through a closure or a getter): slimact's replacement would "
            "leave that tensor without a gradient; left as written")


def _probe_activation(module: nn.Module) -> str | None:
    """The form whose values and derivative the module's forward has on :data:`_PROBE` (slimact's backward computes
    the form's derivative: a straight-through or partly detached forward has another one), else ``None``: on a plain
    vector, and on a ``[2, 4, 329]`` view that is not contiguous, or a contiguous one where the forward refuses that
    (``x.view(-1)``). A forward branching on its input's rank computed GELU on the probe's vector and SiLU on the
    model's ``[B, T, C]``: GELU's gradient there, the first layer's at cosine 0.95 under "tempo", silently (a review,
    2026-12-07). Every shape it takes must give the one form."""
    if not _looks_like_activation(module):
        return None
    # Run as the module trains (a dropout inside it, inactive in eval, where a loaded model is converted, would
    # otherwise pass unseen, and the form's derivative would replace the dropped one), over enough copies of the
    # probe that a dropout of 1% drops some element (all but certainly: 0.99^2632 < 1e-11).
    vector = _PROBE.repeat(8)
    form = _form_on(module, vector)
    if form is None or form is _REFUSED:
        return None
    shaped = _form_on(module, vector.view(2, -1, 4).transpose(1, 2))
    if shaped is _REFUSED:
        shaped = _form_on(module, vector.view(2, 4, -1))
    return form if shaped == form else None


#: What :func:`_form_on` gives where the forward refuses the probe (raises).
_REFUSED = "<slimact: refused the probe>"


def _form_on(module: nn.Module, probe: Tensor) -> str | None:
    """The form the module's forward computes on ``probe``, values and derivative; ``None``; or :data:`_REFUSED`."""
    from slimact.functional.activation import FORMS, derivative, reference

    x = probe.detach().clone().requires_grad_(True)
    try:
        with _probing_grad(), _training(module):
            y = _cls(module).forward(module, x * 1.0)  # (not the leaf itself: an in-place activation writes into it)
    except _PROBE_ERRORS:  # cannot run on this probe: on a plain vector, not a pointwise activation
        return _REFUSED
    if not isinstance(y, Tensor) or y.shape != probe.shape or not y.requires_grad:
        return None
    form = next((form for form in FORMS if torch.allclose(y.detach().double(), reference(form, probe.double()),
                                                          rtol=1e-5, atol=2e-6)), None)
    if form is None:
        return None
    with _probing_grad():
        (grad,) = torch.autograd.grad(y.sum(), x)
    exact = (probe > 0).double() if form == "relu" else derivative(form, probe.double())
    return form if torch.allclose(grad.double(), exact, rtol=1e-4, atol=1e-5) else None


def activation_form(module: nn.Module) -> str | None:
    """``"gelu"``, ``"gelu_tanh"``, ``"quick_gelu"``, ``"silu"``, ``"relu"`` or ``"relu2"`` if ``module`` computes that
    activation and its derivative (to fp32 rounding on [-8, 8] and at points out to 1e4), else ``None``."""
    found = recognise(module)
    return found.extra.get("form") if found.replace == "activation" else None


# ---------------------------------------------------------------------------------------------------- norms


def norm_eps(module: nn.Module) -> float | None:
    """A norm module's epsilon (its ``eps``, ``variance_epsilon`` or ``epsilon`` attribute), if a float."""
    eps = next((getattr(module, a) for a in ("eps", "variance_epsilon", "epsilon") if hasattr(module, a)), None)
    return eps if isinstance(eps, float) else None


def _probe_norm(module: nn.Module, weight: Tensor, eps: float) -> tuple[dict, str | None] | None:
    """``(form, None)`` if the module's own forward computes a last-dim LayerNorm or RMSNorm (Gemma's ``1 + w``)
    of ``[2, 3, C]`` and ``[2, 2, 2, C]`` probes (a forward that permutes 4-d inputs fails the second), with its
    gradients; ``(form, why not)`` where it does, but not where its ``eps`` shows (:func:`_eps_probe`).

    The probe runs with the module's weight (and bias) set, for its duration, to random non-uniform values, and
    restored: a weight at its initial value (all ones, or all zeros under ``1 + w``) scales every channel alike,
    and a norm then cannot tell ``norm(x) * (1 + w)`` from a norm that scales its input first,
    ``norm(x * (1 + w))`` (MuseSpark's input-scaled RMSNorm), whose gradients differ as soon as ``w`` moves.
    """
    with _shifted_params(module, weight) as gen:
        form = _probe_norm_as_is(module, weight, eps, gen)
        if form is None:
            return None
        # (at eps with the forward probe's weights, the gradient check sets others, of both signs; and that reason
        # first: the gradient probe's rows without variance, where the gradient is 1 / sqrt(eps), tell another
        # epsilon too, without saying so)
        if _probe_norm_as_is(module, weight, eps, gen, form, shapes=((2, 3),)) is None:
            return form, (
                f"{_cls(module).__name__} computes a last-dim norm on a probe, but not with its epsilon ({eps:g}) at "
                "inputs of mean square near it: its forward uses another epsilon, or adds it elsewhere (to the rms, "
                "as a clamp), and slimact's backward, which computes with the attribute's, would be off on small "
                "inputs")
        if not _has_norm_gradients(module, weight, form, gen):
            return None
        return form, None


def _eps_probe(shape: tuple[int, ...], eps: float, dtype: torch.dtype, device: torch.device,
               gen: torch.Generator) -> Tensor:
    """A probe on which a norm's ``eps`` shows: rows of variance ``eps / 2`` (about half of what is under the root
    is ``eps``), where the big probes' (variance 9) leave it 1e-7 of the result. A forward that uses another
    epsilon than its attribute, or adds it to the rms or clamps with it, computes the form on those and other
    values here, and slimact's backward, computed with the attribute's epsilon, was off on small inputs ("tempo": a
    weight gradient 9e-4 off at an input of std 1e-2, with 1e-5 in the forward and 1e-6 as ``eps``). In fp16 the
    rows are no smaller than its squares stay normal at (variance 1.2e-4; smaller, a forward computing in fp16 is
    off by its subnormals' rounding, not by its epsilon): there an epsilon of 1e-5 off by half, or one of 1e-6 off
    by a factor 10, still shows; one of 1e-6 off by half, or any about 1e-8, does not (below fp16's rounding on
    rows of that size)."""
    var = max(eps / 2, 2 * torch.finfo(dtype).tiny, 1e-12)
    return ((torch.randn(*shape, generator=gen) + 1 / 3) * var ** 0.5).to(device=device, dtype=dtype)


def _own_weight_and_bias(module: nn.Module, weight: Tensor | None) -> list[nn.Parameter]:
    """``weight`` and the module's ``bias`` where each is a parameter of the module itself, each once (what a norm's
    probe sets, differentiates and restores)."""
    own: list[nn.Parameter] = []
    for p in (weight, getattr(module, "bias", None)):
        if (isinstance(p, nn.Parameter) and any(p is q for q in module.parameters(recurse=False))
                and not any(p is q for q in own)):
            own.append(p)
    return own


@contextlib.contextmanager
def _shifted_params(module: nn.Module, weight: Tensor | None) -> Iterator[torch.Generator]:
    """A norm's probe's setting (see :func:`_probe_norm`): its own weight (``weight``) and bias shifted by random
    non-uniform values, the module in training mode (a dropout in its forward: see :func:`_probe_activation`);
    what it held restored after. Gives the probe's generator."""
    gen = torch.Generator().manual_seed(0)
    own = _own_weight_and_bias(module, weight)
    saved = [p.detach().clone() for p in own]
    try:
        with torch.no_grad():
            for p in own:
                shift = torch.rand(p.shape, generator=gen) - (0.5 if p is not weight else 0.0)
                p.add_(shift.to(device=p.device, dtype=p.dtype))
        with _training(module):
            yield gen
    finally:
        with torch.no_grad():
            for p, value in zip(own, saved, strict=True):
                p.copy_(value)


def _probe_norm_as_is(module: nn.Module, weight: Tensor, eps: float, gen: torch.Generator, found: dict | None = None,
                      shapes: tuple[tuple[int, ...], ...] = ((2, 3), (2, 2, 2))) -> dict | None:
    """The form the module's forward computes on probes of ``shapes`` (each ``[*shape, C]``), if one form for all.
    With ``found`` (a form), whether it computes that one at the scale where ``eps`` shows (:func:`_eps_probe`)."""
    cls, dtype = _cls(module), weight.dtype
    tol = _tolerance(dtype)
    w = weight.detach().float()
    bias = getattr(module, "bias", None)
    b = bias.detach().float() if isinstance(bias, Tensor) else 0.0
    small = found is not None
    for i, shape in enumerate(shapes):
        if small:
            x = _eps_probe((*shape, weight.numel()), eps, dtype, weight.device, gen)
        else:
            x = (torch.randn(*shape, weight.numel(), generator=gen) * 3 + 1).to(device=weight.device, dtype=dtype)
            if i == 0:
                x = _with_edge_rows(x)
        try:
            # (warnings the probe itself provokes are not the user's: nn.InstanceNorm1d without affine warned
            # "input's size at dim=1 does not match num_features" at every convert)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y = cls.forward(module, x)
        except _PROBE_ERRORS:  # not a plain [..., C] -> [..., C] norm
            return None
        if not isinstance(y, Tensor) or y.shape != x.shape:
            return None
        xf, y = x.float(), y.float()
        rms = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        var, mean = torch.var_mean(xf, -1, unbiased=False, keepdim=True)
        centered = (xf - mean) * torch.rsqrt(var + eps)
        candidates = [(centered, True, 0), (rms, False, 0), (rms, False, 1)]  # (integers: see nn.norm's offset)
        match = next(({"centered": c, "offset": o, "eps": eps} for xn, c, o in candidates
                      if _sum_close(y, xn * (w + o), b, tol)), None)
        if match is None or (found is not None and match != found):
            return None
        found = match
    return found


def _with_edge_rows(x: Tensor) -> Tensor:
    """``x`` (``[2, 3, C]`` probe rows) with its first three rows made ones a norm's probe must also see: all zeros
    (a padded token), a constant (no variance: a LayerNorm gives its bias on both), and one channel far above the
    others (its normalised value near ``sqrt(C)``). A forward that keeps padded rows at zero (``norm(x) * (x != 0)
    .any(-1)``) or clamps what it normalises computes a norm on every other row, and was converted, its gradients
    then slimact's norm's (a pad-aware LayerNorm's bias gradient 16% off under "tempo", silently; a review,
    2026-12-07). The outlier's square is a sixteenth of the dtype's largest value at most (fp16: 64). In fp16 the rows
    without variance are left out: there ``1 / sqrt(eps)`` (the gradient on them) overflows, or ``eps`` itself
    rounds to zero, for epsilons fp16 norms use."""
    c = x.shape[-1]
    x = x.clone()
    if x.dtype != torch.float16:
        x[0, 0] = 0
        x[0, 1] = 2.5
    x[0, 2, 0] = min(10 * c ** 0.5, torch.finfo(x.dtype).max ** 0.5 / 4, 1e4)
    return x


def _sum_close(y: Tensor, a: Tensor, b: Tensor | float, tol: float) -> bool:
    """Whether ``y`` is ``a + b`` to ``tol`` of its terms' sizes: a forward computing in bf16/fp16 rounds the terms,
    and where they cancel (a norm's ``xn * w`` against its bias) that rounding is not a fraction of the sum."""
    return bool(((y - (a + b)).abs() <= tol * (a.abs() + abs(b)) + tol / 10).all())


def _has_norm_gradients(module: nn.Module, weight: Tensor, form: dict, gen: torch.Generator) -> bool:
    """Whether the gradients the module's forward gives its input and its own weight and bias are the norm
    ``form``'s, which slimact's backward computes, with the weight (and bias) set, for the probe, to values of both
    signs and of every size: a forward that uses its weight through ``abs()``, ``clamp(min=...)``, ``detach()`` (or
    its input's statistics detached) computes the form's values on the forward probe's positive weights, with
    other gradients ("tempo" gave an RMSNorm with ``weight.abs()`` input gradients 0.34 off, and a detached weight
    a gradient where PyTorch's has none, silently). Run in the forward probe's setting (:func:`_shifted_params`,
    which restores the parameters after)."""
    eps = form["eps"]

    def reference(xf: Tensor, wf: Tensor | None, bf: Tensor | None) -> Tensor:
        if form["centered"]:
            var, mean = torch.var_mean(xf, -1, unbiased=False, keepdim=True)
            xn = (xf - mean) * torch.rsqrt(var + eps)
        else:
            xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return xn * (wf + form["offset"]) + (bf if bf is not None else 0.0)

    shape = (2, 3, weight.numel())
    # (the edge rows apart: their gradients, 1 / sqrt(eps) on a zero row, would set the others' tolerance)
    return all(_has_reference_gradients(module, weight, shape, weight.dtype, weight.device, reference, gen, edge)
               for edge in (False, True))


def _has_reference_gradients(module: nn.Module, weight: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                             device: torch.device, reference: Callable, gen: torch.Generator,
                             edge: bool = False) -> bool:
    """Whether ``module``'s forward on a ``shape`` probe gives its input, and its own ``weight`` and ``bias``
    parameters, the gradients of ``reference(x, weight, bias)`` (computed in fp32), to twice its dtype's probe
    tolerance, with those parameters set to random values of both signs first (see :func:`_has_norm_gradients`).
    With ``edge``, the probe's first rows are :func:`_with_edge_rows`'s."""
    cls = _cls(module)
    bias = getattr(module, "bias", None)
    params = _own_weight_and_bias(module, weight)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype))
    x = (torch.randn(*shape, generator=gen) * 3 + 1).to(device=device, dtype=dtype)
    if edge:
        x = _with_edge_rows(x)
    flags = [p.requires_grad for p in params]
    try:
        with _probing_grad():
            for p in params:
                p.requires_grad_(True)
            xg = x.clone().requires_grad_(True)
            y = cls.forward(module, xg)
            if not isinstance(y, Tensor) or y.shape != x.shape or not y.requires_grad:
                return False
            v = torch.randn(y.shape, generator=gen).to(y)
            got = torch.autograd.grad(y, (xg, *params), v, allow_unused=True)
    except _PROBE_ERRORS:
        return False
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
    with _probing_grad():
        xf = x.float().requires_grad_(True)
        wf, bf = (t.detach().float().requires_grad_(True) if isinstance(t, Tensor) else None for t in (weight, bias))
        yf = reference(xf, wf, bf)
        want = torch.autograd.grad(yf, (xf, *(wf if p is weight else bf for p in params)), v.float())
    tol = _tolerance(dtype)
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        if g is None or not torch.allclose(g.float(), w, rtol=2 * tol, atol=2 * tol * scale):
            return False
    return True


def _probe_group_norm(module: nn.GroupNorm) -> bool:
    """Whether a subclass of ``nn.GroupNorm`` with a forward of its own (guided diffusion's ``GroupNorm32``, which
    runs it in fp32) computes ``F.group_norm`` of its ``num_groups``, weight, bias and ``eps`` on ``[2, C, 3]`` and
    ``[2, C, 2, 3]`` probes, within its parameters' dtype's rounding (weight and bias shifted as
    :func:`_probe_norm` shifts them; a forward that cannot run on them, or gives another shape, is no GroupNorm), with
    its gradients (:func:`_has_reference_gradients`)."""
    cls, (device, dtype) = _cls(module), _params_of(module)
    weight, bias = (t if isinstance(t, Tensor) else None for t in (module.weight, module.bias))
    if not isinstance(module.eps, float) or not isinstance(module.num_groups, int) or module.num_groups < 1:
        return False
    tol = _tolerance(dtype)
    with _shifted_params(module, weight) as gen:
        w, b = (None if t is None else t.detach().float() for t in (weight, bias))
        for shape in ((2, module.num_channels, 3), (2, module.num_channels, 2, 3)):
            x = (torch.randn(*shape, generator=gen) * 3 + 1).to(device=device, dtype=dtype)
            try:
                with torch.no_grad():
                    y = cls.forward(module, x)
            except _PROBE_ERRORS:  # not an [N, C, *] -> [N, C, *] norm
                return False
            if not isinstance(y, Tensor) or y.shape != x.shape:
                return False
            want = nn.functional.group_norm(x.float(), module.num_groups, w, b, module.eps)
            if not torch.allclose(y.float(), want, rtol=tol, atol=tol / 10):
                return False
        # (and its gradients: a forward using its weight through abs() or detach() was converted; "int8"'s input
        # gradients at cosine 0.46 to PyTorch's, a detached weight given a gradient)
        return _has_reference_gradients(
            module, weight, (2, module.num_channels, 2, 3), dtype, device,
            lambda xf, wf, bf: nn.functional.group_norm(xf, module.num_groups, wf, bf, module.eps), gen)


def norm_form(module: nn.Module) -> dict | None:
    """``{"centered", "offset", "eps"}`` if ``module`` is a LayerNorm (centered) or an RMSNorm (Gemma's
    ``1 + weight``: ``offset=1``) over its last dim, by what it computes; else ``None``. A norm whose weight is its
    one parameter under another name than ``weight`` (torchtune's ``scale``) has that name as ``"weight_name"``."""
    found = recognise(module)
    return found.extra if found.replace == "norm" else None


# ------------------------------------------------------------------------------------------------ gated MLP


def gated_layout(module: nn.Module) -> GatedLayout | None:
    """Where a gated MLP holds its parts: where a converted block has them, else where :func:`recognise` found
    them, else in Hugging Face's names (:data:`GATED_MLP_PARTS`; a block converted, then pickled, by a slimact
    from before :class:`GatedLayout` has no layout of its own, and only ever had those names)."""
    return module.__dict__.get("_slimact_layout") or recognise(module).extra.get("layout") or _named_layout(module)


def _named_layout(module: nn.Module) -> GatedLayout | None:
    """The parts in Hugging Face's names (:data:`GATED_MLP_PARTS`), where the module has them."""
    get, names = module._modules.get, GATED_MLP_PARTS
    act = next((n for n in names["act"] if get(n) is not None), None)
    if act is None or get(names["down"]) is None:
        return None
    if isinstance(get(names["gate_up"]), nn.Linear):
        return GatedLayout(names["down"], gate_up=names["gate_up"], act=act)
    if get(names["gate"]) is None or get(names["up"]) is None:
        return None
    return GatedLayout(names["down"], gate=names["gate"], up=names["up"], act=act)


def _shaped_layouts(module: nn.Module) -> list[GatedLayout]:
    """Every way a module of other names could hold a gated MLP, by its children's shapes: two or three
    ``nn.Linear`` children (fused ``[D -> 2I]`` and ``[I -> D]``, either half first; or two ``[D -> I]`` and one
    ``[I -> D]``, in every assignment) and at most one activation module besides, nothing else, no parameter of
    its own. The probe (:func:`_probe_gated_mlp`) decides which one, if any, the forward computes."""
    children = list(module._modules.items())
    linears = [(n, m) for n, m in children if isinstance(m, nn.Linear)]
    others = [(n, m) for n, m in children if not isinstance(m, nn.Linear)]
    if len(linears) not in (2, 3) or len(others) > 1 or next(module.parameters(recurse=False), None) is not None:
        return []
    act = others[0][0] if others else None
    if others and (not _looks_like_activation(others[0][1]) or activation_form(others[0][1]) is None):
        return []
    layouts = []
    for order in itertools.permutations(linears):
        *ups, (down, d) = order
        if any(m.in_features != d.out_features for _, m in ups):
            continue
        if len(ups) == 1 and ups[0][1].out_features == 2 * d.in_features:
            layouts += [GatedLayout(down, gate_up=ups[0][0], gate_first=first, act=act) for first in (True, False)]
        elif len(ups) == 2 and all(m.out_features == d.in_features for _, m in ups):
            layouts.append(GatedLayout(down, gate=ups[0][0], up=ups[1][0], act=act))
    return layouts


#: Tensors of a probed module up to this many elements are copied before the probe and put back after; a larger
#: one (a gated MLP's projection) is only watched (its version counter), and an in-place change is an error.
_KEPT_NUMEL = 1 << 20
#: A module's ``__dict__`` entries :class:`_KeptState` does not take as plain attributes (its tables, its mode).
_NOT_ATTRS = ("_parameters", "_buffers", "_modules", "training")


class _KeptState:
    """A module's parameters, buffers and plain attributes (recursively) as they were before a probe ran its
    training forward, put back after. ``convert`` must not change what a model holds (its ``state_dict`` is the
    same after), and a forward may write it: a norm of the model's own with running statistics (updated with the
    probe's random rows), a data-dependent initialisation on the first training batch (Glow's ActNorm), a call
    counter."""

    def __init__(self, module: nn.Module) -> None:
        self.tables: list[tuple[dict, dict]] = []  # (a module's _parameters or _buffers, its entries as they were)
        self.tensors: list[tuple[str, Tensor, int | None, Tensor | None]] = []  # (name, tensor, version, copy)
        self.attrs: list[tuple[nn.Module, dict]] = []
        self.contents: list[tuple[object, object]] = []  # (a plain attribute a forward may change in place, its copy)
        for prefix, m in module.named_modules():
            for table in (m._parameters, m._buffers):
                self.tables.append((table, dict(table)))
                for name, t in table.items():
                    if t is None:
                        continue
                    version = None if t.is_inference() else t._version
                    copy = t.detach().clone() if t.numel() <= _KEPT_NUMEL and not t.is_meta else None
                    self.tensors.append((f"{prefix}.{name}" if prefix else name, t, version, copy))
            self.attrs.append((m, {k: v for k, v in m.__dict__.items() if k not in _NOT_ATTRS}))
            self.contents += [(v, c) for k, v in m.__dict__.items() if k not in _NOT_ATTRS
                              and (c := _contents(v)) is not None]

    def restore(self, module: nn.Module) -> None:
        for m, before in self.attrs:
            for key in [k for k in m.__dict__ if k not in before and k not in _NOT_ATTRS]:
                del m.__dict__[key]  # set by the forward
            for key, value in before.items():
                if m.__dict__.get(key, _KeptState) is not value:
                    m.__dict__[key] = value
        for table, before in self.tables:  # entries the forward added, removed or assigned anew
            table.clear()
            table.update(before)
        changed = []
        with torch.no_grad():
            for held, contents in self.contents:  # (a call counter `self.calls += 1`, statistics appended to a list)
                if isinstance(held, Tensor):
                    if held.shape == contents.shape and not torch.equal(held, contents):
                        held.copy_(contents)
                else:  # (refilled, not compared: a list of tensors has no truth value to compare by)
                    held.clear()
                    held.update(contents) if isinstance(held, (dict, set)) else held.extend(contents)
            for name, t, version, copy in self.tensors:
                if copy is not None:
                    if t.shape != copy.shape and not t.requires_grad:  # (a buffer an `out=` resized)
                        t.resize_(copy.shape)
                    if t.shape != copy.shape:
                        changed.append(name)
                    elif not torch.equal(t, copy):  # (also a write through .data, which no version counter sees)
                        t.copy_(copy)
                elif version is not None and t._version != version:
                    changed.append(name)
        if changed:
            raise RuntimeError(
                f"slimact: recognising {type(module).__name__} ran its forward on a probe, which changed "
                f"{', '.join(changed[:3])} in place; slimact cannot put such a large tensor back. Exclude the module "
                "(convert's filter_fn) or make its forward leave its parameters and buffers alone in training mode."
            )


def _contents(value: object) -> object | None:
    """A copy of what a plain attribute holds, where a forward may change it in place keeping its identity (which
    :class:`_KeptState` puts back): a small tensor's values, a list's, dict's or set's items; else ``None``. Left
    advanced by the probes, a tensor call counter made a converted model's forward differ from plain's for as many
    steps (a review, 2026-12-07)."""
    if isinstance(value, Tensor):
        usable = not value.is_meta and not value.is_inference() and value.layout is torch.strided
        return value.detach().clone() if usable and value.numel() <= _KEPT_NUMEL else None
    return type(value)(value) if type(value) in (list, dict, set) else None


@contextlib.contextmanager
def _training(module: nn.Module) -> Iterator[None]:
    """``module`` and its children in training mode for a probe (what a converted module computes in training
    counts: a dropout in the block, inactive in eval, where a model loaded by ``from_pretrained`` is converted),
    their modes, the RNG state (what a dropout draws) and what they hold (:class:`_KeptState`) restored after."""
    modes = [(m, m.training) for m in module.modules()]
    device = _params_of(module)[0]
    kept = _KeptState(module)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            module.train(True)
            yield
        finally:
            for m, mode in modes:
                m.training = mode
            kept.restore(module)


def _gated_forms(module: nn.Module, layout: GatedLayout) -> tuple[str, ...]:
    """The activation forms ``layout`` could fuse with in ``module``: none where a part is not a plain Linear
    (an adapter or a quantised layer: the block is left as written) or runs hooks (the fused block never calls
    the down projection or the activation: their hooks would not run; one changing act's output would pass the
    probe, its act(g) running the hook too, but the backward would differentiate the bare form)."""
    from slimact.nn._base import SlimModule

    gate_up, gate, up, down, act = layout.parts(module)
    projections = (gate_up,) if layout.gate_up is not None else (gate, up)
    if not all(isinstance(p, nn.Linear) for p in (*projections, down)):
        return ()
    if (type(down) is not nn.Linear and not isinstance(down, SlimModule)) or _runs_hooks(down):
        return ()
    if act is None:
        return tuple(_GATED_CALLS)
    form = activation_form(act)
    return (form,) if form in _GATED_CALLS and not _runs_hooks(act) else ()  # (the fused block's smooth forms)


#: The gated MLP probe's second input: ``[3, 5, D]`` rows of the first's scale times this (at most; a quarter power
#: of the dtype's largest value, so that the product ``act(g) * u`` of an fp16 block stays finite).
_GATED_PROBE_SCALE = 100.0


def _gated_probe_inputs(dim: int, dtype: torch.dtype) -> list[Tensor]:
    """The inputs a gated MLP's forward is probed on: ``[3, D]`` rows of unit scale (the last all zeros), and
    ``[3, 5, D]`` rows of a large one. The converted block computes ``down(act(gate(x)) * up(x))`` on every input;
    a forward that computes it on the first only (a branch on the input's rank or length, a clamp only large values
    reach: GPT-OSS's ``swiglu_limit``, an fp16 guard) would otherwise be fused and silently replaced."""
    gen = torch.Generator().manual_seed(0)
    big = min(_GATED_PROBE_SCALE, torch.finfo(dtype).max ** 0.25)
    # (a zero row too: a forward keeping padded rows at zero, ``mlp(x) * (x != 0).any(-1)``, had been fused, and its
    # fused forward gave biased blocks' padded rows 0.15 where PyTorch's gives 0; a review, 2026-12-07)
    unit = torch.cat([torch.randn(2, dim, generator=gen), torch.zeros(1, dim)])
    return [unit, torch.randn(3, 5, dim, generator=gen) * big]


def _gated_calls(module: nn.Module, names: set[str], x: Tensor) -> tuple[Tensor, dict] | None:
    """``module``'s training forward of ``x`` with what its Linear children ``names`` were called with: ``(y,
    {name: (its input, its output, the output as it was returned: the forward may write into it after, and the
    input as it was passed, in the forward's graph)})``, or ``None`` where the forward fails, returns no
    differentiable tensor or calls one of them other than once."""
    calls: dict[str, list[tuple[Tensor | None, Tensor, Tensor, Tensor | None]]] = {n: [] for n in names}

    def watch(n: str, args: tuple, out: Tensor) -> None:
        t = args[0] if args and isinstance(args[0], Tensor) else None
        calls[n].append((None if t is None else t.detach().clone(), out, out.detach().clone(), t))

    handles = [module._modules[n].register_forward_hook(lambda m, args, out, n=n: watch(n, args, out))
               for n in names]
    try:
        with _probing_grad(), _training(module):
            y = _cls(module).forward(module, x)
    except _PROBE_ERRORS:  # needs more than one tensor argument: not this kind of block
        return None
    finally:
        for h in handles:
            h.remove()
    if not isinstance(y, Tensor) or not y.requires_grad or any(len(c) != 1 for c in calls.values()):
        return None
    return y, {n: c[0] for n, c in calls.items()}


def _gate_and_up(layout: GatedLayout, calls: dict) -> tuple[Tensor, Tensor]:
    """The gate and up projections the forward computed, as returned (detached)."""
    if layout.gate_up is not None:
        return layout.split(calls[layout.gate_up][2])
    return calls[layout.gate][2], calls[layout.up][2]


def _computes_gated(module: nn.Module, layout: GatedLayout, form: str, x: Tensor, y: Tensor, calls: dict,
                    cast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> bool:
    """Whether the forward's calls on ``x`` (run under ``cast()``, an autocast or nothing) are ``layout``'s gated MLP
    with ``form``: the gate and up projections of ``x`` itself, the output the down projection's (either possibly
    with its rows flattened, ``x.reshape(-1, D)``, the output then of ``x``'s shape, as the fused block's is), what
    reached the down projection bit for bit the fused block's product ``act(g) * u`` (its dtype too): a forward
    computing it in another precision, or by a formula written out (``g * torch.sigmoid(g) * u``), would give the
    converted model another forward, by a rounding."""
    from slimact.functional.activation import reference

    h, out, *_ = calls[layout.down]
    inputs = [calls[n][0] for n in (layout.gate_up, layout.gate, layout.up) if n]
    if y.shape != (*x.shape[:-1], out.shape[-1]) or not _same_rows(out, y) or not all(
            isinstance(t, Tensor) and _same_rows(t, x) for t in inputs):
        return False
    g, u = _gate_and_up(layout, calls)
    with _probing_grad(), torch.no_grad(), cast():
        act = layout.parts(module)[4]
        fn = act if act is not None else (_GATED_CALLS[form] or functools.partial(reference, form))
        expected = fn(g) * u
    return expected.shape == h.shape and expected.dtype == h.dtype and torch.equal(h, expected)


def _same_rows(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is ``b``, its rows (last dim) possibly flattened or reshaped in order."""
    return a.shape[-1] == b.shape[-1] and a.numel() == b.numel() and torch.equal(a.reshape(b.shape), b)


def _has_form_gradients(module: nn.Module, layout: GatedLayout, form: str, x: Tensor, y: Tensor,
                        calls: dict) -> bool:
    """Whether the gradients the model's code gives gate(x) and up(x) (through its down projection, whose input
    gradient is exact whatever slimact keeps) are the form's, which the fused block computes, and whether what
    the gate and up projections were given passes its gradient to ``x`` unchanged, as the fused block's call of
    them on ``x`` does (not ``w3(x.detach())``, nor a straight-through scale: equal values, other gradients)."""
    from slimact.functional.activation import derivative, reference

    tol = _tolerance(y.dtype)
    for n in (n for n in (layout.gate_up, layout.gate, layout.up) if n is not None):
        passed = calls[n][3]
        if passed is None or not passed.requires_grad:
            return False
        v = torch.randn(passed.shape, generator=torch.Generator().manual_seed(2)).to(passed)
        with _probing_grad():
            (got,) = torch.autograd.grad(passed, x, v, retain_graph=True, allow_unused=True)
        if got is None or not torch.allclose(got.float(), v.reshape(x.shape).float(), rtol=tol, atol=tol):
            return False
    down = layout.parts(module)[3]
    outputs = (calls[layout.gate_up][1],) if layout.gate_up is not None else (calls[layout.gate][1],
                                                                              calls[layout.up][1])
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    with _probing_grad():
        grads = torch.autograd.grad(y, outputs, grad_y, allow_unused=True)
    if any(grad is None for grad in grads):
        return False
    grad_g, grad_u = grads if layout.gate_up is None else layout.split(grads[0])
    g, u = _gate_and_up(layout, calls)
    with torch.no_grad():  # (as rows: the forward may have flattened them)
        g32, u32 = g.float().reshape(-1, g.shape[-1]), u.float().reshape(-1, u.shape[-1])
        grad_h = grad_y.float().reshape(-1, y.shape[-1]) @ down.weight.float()  # [rows, I]
        exact = (grad_h * u32 * derivative(form, g32), grad_h * reference(form, g32))
    for got, want in zip((grad_g, grad_u), exact, strict=True):
        scale = want.abs().max().item()
        if not torch.allclose(got.float().reshape(want.shape), want, rtol=2 * tol, atol=2 * tol * scale):
            return False
    return True


def _probe_gated_mlp(module: nn.Module, layouts: list[GatedLayout]) -> list[tuple[GatedLayout, str]]:
    """The ``(layout, form)`` for which ``module``'s training forward computes ``down(act(gate(x)) * up(x))`` on
    every probe (:func:`_gated_probe_inputs`), and its gradients to ``gate(x)`` and ``up(x)`` are the form's (a
    detached or straight-through gate would have others) and reach ``x`` unchanged: the forward's own calls of
    its Linear children are watched (each called once, the gate and up projections on the probe, the output the
    down projection's) and what reached the down projection is compared with the form's product of what the
    others returned (so a zero down projection, as some initialisations make it, hides nothing)."""
    candidates = [(layout, form) for layout in layouts for form in _gated_forms(module, layout)]
    if not candidates:
        return []
    names = {n for layout, _ in candidates for n in (layout.gate_up, layout.gate, layout.up, layout.down) if n}
    first = module._modules[next(iter(names))]
    dim = candidates[0][0].parts(module)[3].out_features  # (every layout's model width)
    probes = [(x, contextlib.nullcontext) for x in _gated_probe_inputs(dim, first.weight.dtype)]
    if first.weight.dtype == torch.float32 and torch.amp.is_autocast_available(first.weight.device.type):
        # An fp32 block is trained under bf16 autocast too: a forward that computes the product in fp32 there
        # (BEAM's `act(gate(x).float()) * up(x).float()`) rounds differently from the fused block's bf16 product.
        autocast = functools.partial(torch.autocast, first.weight.device.type, torch.bfloat16)
        probes.append((probes[0][0], autocast))
        # and on a bf16 input, as a layer before it hands one over there: a forward choosing its activation by the
        # input's dtype (`F.silu if x.dtype == torch.float32 else F.gelu`) computed another form than the fused
        # block's under autocast, 0.03 off at outputs of 0.2 (a review)
        probes.append((probes[0][0].to(torch.bfloat16), autocast))
    observed = []
    for x, cast in probes:
        extra = x.dtype == torch.bfloat16  # (what a forward refuses there is no evidence: one asserting its input's
        # dtype is its weight's, fused before this probe, made convert raise)
        x = x.to(device=first.weight.device, dtype=first.weight.dtype if not extra else x.dtype)
        x.requires_grad_(True)
        try:
            with cast():
                seen = _gated_calls(module, names, x)
        except _PROBE_ERRORS:  # (anything else is a bug and propagates: module docstring)
            if not extra:
                raise
            continue
        if seen is None:
            if extra:
                continue
            return []
        observed.append((x, *seen, cast))
    found = [(layout, form) for layout, form in candidates
             if all(_computes_gated(module, layout, form, x, y, calls, cast) for x, y, calls, cast in observed)]
    act = found[0][0].parts(module)[4] if len(found) == 1 else None
    if len(found) != 1 or (act is not None and _writes_its_input(act)):  # (the rule says why it is left alone)
        return found
    ((layout, form),) = found
    if not all(_has_form_gradients(module, layout, form, x, y, calls)
               for x, y, calls, cast in observed if cast is contextlib.nullcontext):
        return []
    return found


# ---------------------------------------------------------------------------------------------------- rules


def gated_mlp_form(module: nn.Module) -> str | None:
    """The activation form if ``module`` is a gated MLP slimact can fuse, else ``None``."""
    found = recognise(module)
    return found.extra.get("form") if found.replace == "mlp" else None


def gated_mlp_intact(module: nn.Module, form: str) -> bool:
    """Whether a gated MLP converted with activation ``form`` still has the parts it was recognised with: a plain
    ``nn.Linear`` down projection and, where it has an activation module, one of that form, not in place, neither
    with hooks; projections whose weights are plain tensors (:func:`foreign_weight`). Model code (an adapter
    library, a user's hook) can change them after ``convert``; the fused block, which uses the down projection's
    weight without calling it, would then silently compute something else."""
    from slimact.nn._base import SlimModule

    layout = gated_layout(module)
    *projections, down, act = layout.parts(module)
    # (a weight quantised after convert: the block runs as written, through the projections' own F.linear)
    if any(isinstance(p, nn.Linear) and foreign_weight(p.weight) for p in (*projections, down)):
        return False
    if layout.act is not None and (act is None or getattr(act, "inplace", False) or _runs_hooks(act) or (
            type(act) is not module.__dict__.get("_slimact_act_type") if torch.compiler.is_compiling()
            else activation_form(act) != form)):
        return False
    return (type(down) is nn.Linear or isinstance(down, SlimModule)) and not _runs_hooks(down)


def _state_beyond(module: nn.Module, allowed: Iterable[Tensor]) -> list[str]:
    """Names of ``module``'s parameters and buffers that are not among ``allowed``: state
    a replacement computing a known form from ``allowed`` alone would not differentiate (a parameter) or would
    read only as it was when probed (a layer scale initialised to ones, loaded from a checkpoint after convert)."""
    ids = {id(t) for t in allowed}
    return [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if id(t) not in ids]


def _rule_gated_mlp(module, cls):
    named = _named_layout(module)
    layouts = [named] if named is not None else _shaped_layouts(module)
    # (the probe cannot run the fused block's products on such weights: it would find nothing and say nothing)
    if foreign := next(filter(None, (foreign_weight(part.weight) for layout in layouts for part in layout.parts(module)
                                     if isinstance(part, nn.Linear))), None):
        return Recognised("mlp", reason=(
            f"{cls.__name__}'s projections hold {foreign} weights (a tensor subclass, a quantised weight) where it "
            f"{'has' if named is not None else 'has the shapes of'} a gated MLP's: slimact's fused block would "
            "compute with them as plain tensors; its parts are converted on their own"))
    found = _probe_gated_mlp(module, layouts)
    if not found:
        return None
    if len(found) > 1:
        return Recognised("mlp", reason=(
            f"{cls.__name__} computes a gated MLP on a probe in {len(found)} ways (which Linear is the gate, which "
            "the up projection, which activation); slimact cannot tell which: its parts are converted on their own"))
    ((layout, form),) = found
    parts = [part for part in layout.parts(module) if part is not None]
    beyond = _state_beyond(module, (t for part in parts for t in itertools.chain(part.parameters(), part.buffers())))
    if beyond:
        return Recognised("mlp", reason=(
            f"{cls.__name__} computes a gated MLP on a probe but holds {', '.join(beyond[:3])} besides its "
            "projections: slimact's fused block would neither use nor differentiate it; its parts are converted "
            "on their own"))
    down = layout.parts(module)[3]
    if _reads_other_gradients(module, _gated_probe_inputs(down.out_features, down.weight.dtype)[0]
                             .to(device=down.weight.device, dtype=down.weight.dtype)):
        return Recognised("mlp", reason=_reads_other_reason(cls, "a gated MLP") + "; its parts are converted on their "
                          "own")
    if layout.act is not None and _writes_its_input(module._modules[layout.act]):
        return Recognised("mlp", reason=(
            f"{cls.__name__} is a gated MLP whose activation writes into its input (in place): slimact's fused "
            "block keeps the gate projection it would overwrite; its parts are converted on their own"))
    act_type = None if layout.act is None else type(module._modules[layout.act])
    return Recognised("mlp", "mlp", {"form": form, "layout": layout, "act_type": act_type}, parts=layout.computed)


def _writes_its_input(act: nn.Module) -> bool:
    """Whether ``act`` (an activation module) overwrites the tensor it is given: announced (``inplace``), or seen
    on a probe (its version counter or its values changed)."""
    if getattr(act, "inplace", False):
        return True
    device, dtype = _params_of(act)
    x = torch.linspace(-4.0, 4.0, 17, device=device, dtype=dtype)
    before, version = x.clone(), x._version
    with torch.no_grad(), _training(act):
        _cls(act).forward(act, x)
    return x._version != version or not torch.equal(x, before)


def _rule_typed(base: type[nn.Module], kind: str, replace: str, unsupported: Callable | None = None):
    """A torch layer class: replaced when its forward is the torch class's own."""

    def rule(module, cls):
        if not isinstance(module, base):
            return None
        reason = _own_forward(cls) or (unsupported(module) if unsupported is not None else None)
        return Recognised(kind, None if reason else replace, reason=reason,
                          parts=("out_proj",) if replace == "mha" else ())

    return rule


def _conv_unsupported(module: nn.Module) -> str | None:
    cls, base = _cls(module), _torch_base(_cls(module))
    if getattr(cls, "_conv_forward", None) is not getattr(base, "_conv_forward", None):
        # Weight standardisation (BiT's StdConv) written there: slimact's backward would differentiate the raw conv.
        return (f"{cls.__name__} overrides nn.{base.__name__}._conv_forward: slimact's conv would not differentiate "
                "what it computes")
    if getattr(module, "transposed", False):
        return "transposed convolutions are not supported yet"
    if module.padding_mode != "zeros":
        return f"padding_mode {module.padding_mode!r} is not supported yet"
    if isinstance(module.padding, str) and module.padding != "valid":
        return f"padding={module.padding!r} is not supported yet"
    return None


def foreign_linear_weight(module: nn.Module) -> str | None:
    """The class of a Linear's registered weight where it is a tensor subclass slimact's products do not compute with
    (:func:`~slimact.functional._saving.foreign_weight`: torchao's quantised weights), or ``None``. The registered
    parameter, not ``module.weight``: a parametrized weight is computed at each access, spectral norm's power
    iteration moving its buffers as it is."""
    weight = module._parameters.get("weight")
    return foreign_weight(weight) if isinstance(weight, Tensor) else None


def _linear_unsupported(module: nn.Module) -> str | None:
    if (foreign := foreign_linear_weight(module)) is not None:
        # (torchao's quantised Linears keep their class: replaced, each call ran F.linear as written anyway, and the
        # summary counted them converted)
        return (f"its weight is a tensor subclass, {foreign} (a quantised weight, a wrapper), which slimact's "
                "product does not compute with: computed as written")
    return None


def _batch_norm_unsupported(module: nn.Module) -> str | None:
    if isinstance(module, nn.SyncBatchNorm):
        return "SyncBatchNorm reduces its statistics across ranks: not supported yet"
    return None


def _rule_library_linear(library: tuple[str, str], replace: str):
    """A library's own Linear class (Hugging Face's ``Conv1D``, PyTorch Geometric's ``Linear``): replaced when its
    forward is the library class's own."""

    def rule(module, cls):
        base = _library_base(cls, *library)
        if base is None:
            return None
        reason = _own_forward(cls, base)  # an adapter's (LoRA on GPT-2's c_attn), a scaled one's
        return Recognised("linear", None if reason else replace, reason=reason)

    return rule


def named_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm by its class's name: ``Norm`` in it, and no submodules (a model's own norm class,
    a gated one; not a block or wrapper named after the norm it holds, vit-pytorch's ``PreNorm(dim, fn)``)."""
    return "Norm" in _cls(module).__name__ and next(module.children(), None) is None


def _rule_norm(module, cls):
    typed = isinstance(module, (nn.LayerNorm, nn.RMSNorm))
    kind = "layernorm" if isinstance(module, nn.LayerNorm) else "rmsnorm"
    if typed and _own_forward(cls) is None:
        if len(module.normalized_shape) != 1:
            return Recognised(kind, reason="normalised over more than the last dim: not supported yet")
        return Recognised(kind, "norm", {"centered": isinstance(module, nn.LayerNorm), "offset": 0,
                                         "eps": module.eps})
    if not (typed or named_norm(module)) or next(module.children(), None) is not None:
        return None
    weight, eps = getattr(module, "weight", None), norm_eps(module)
    weight_name = "weight"
    own = dict(module.named_parameters(recurse=False))
    if weight is None and len(own) == 1:
        # Its one parameter under another name (torchtune's RMSNorm and GemmaRMSNorm: `scale`): the probe says
        # whether it is the norm's weight, and the replacement reads it by that name.
        ((weight_name, weight),) = own.items()
    probed = None
    if isinstance(weight, nn.Parameter) and weight.dim() == 1 and eps is not None:
        probed = _probe_norm(module, weight, eps)
    elif weight is None and eps is not None and next(module.parameters(), None) is None:
        # A weightless norm written by hand (x * rsqrt(mean(x^2) + eps)): probed at a width of its own choosing.
        probed = _probe_norm(module, torch.ones(48), eps)
    form, refused = probed or (None, None)
    if form is not None:
        kind = "layernorm" if form["centered"] else "rmsnorm"
        if refused is not None:
            return Recognised(kind, reason=refused)
        if weight_name != "weight":
            form = {**form, "weight_name": weight_name}
        beyond = _state_beyond(module, (t for t in (weight, getattr(module, "bias", None)) if isinstance(t, Tensor)))
        if beyond:
            return Recognised(kind, reason=(
                f"{cls.__name__} computes a last-dim norm on a probe but holds {', '.join(beyond[:3])} besides its "
                "weight and bias: slimact's backward would not differentiate it"))
        device, dtype = _params_of(module)
        width = weight.shape[0] if isinstance(weight, Tensor) else 48
        if _reads_other_gradients(module, torch.randn(2, 3, width, generator=torch.Generator().manual_seed(0))
                                 .to(device=device, dtype=dtype)):
            return Recognised(kind, reason=_reads_other_reason(cls, "a last-dim norm"))
        return Recognised(kind, "norm", form)
    if typed:
        return Recognised(kind, reason=_own_forward(cls) + " (its probe is not a last-dim norm)")
    return None


def _rule_group_norm(module, cls):
    """``nn.GroupNorm``, and a subclass with its own forward that computes one on a probe (else left alone)."""
    if not isinstance(module, nn.GroupNorm):
        return None
    reason = _own_forward(cls)
    if reason is None:
        return Recognised("groupnorm", "groupnorm")
    if next(module.children(), None) is not None or not _probe_group_norm(module):
        return Recognised("groupnorm", reason=reason + " (its probe is not a GroupNorm)")
    beyond = _state_beyond(module, (t for t in (module.weight, module.bias) if isinstance(t, Tensor)))
    if beyond:
        return Recognised("groupnorm", reason=(
            f"{cls.__name__} computes a GroupNorm on a probe but holds {', '.join(beyond[:3])} besides its weight and "
            "bias: slimact's backward would not differentiate it"))
    return Recognised("groupnorm", "groupnorm")


def _rule_exact(base: type[nn.Module], kind: str, replace: str):
    """A module of exactly ``base`` (a subclass may compute anything: left alone)."""

    def rule(module, cls):
        if not isinstance(module, base):
            return None
        if cls is not base:
            return Recognised(kind, reason=f"{cls.__name__} subclasses nn.{base.__name__}: left as written")
        if getattr(module, "inplace", False) is True:  # (torchvision's EfficientNet and MobileNetV3 heads)
            return Recognised(kind, reason="in place (inplace=True): PyTorch's own runs, whose mask is kept as it is; "
                                           "slimact's keeps a mask as bits out of place only")
        return Recognised(kind, replace)

    return rule


def _rule_matmul(module, cls):
    from slimact.nn.matmul import MatMulBase

    return Recognised("matmul", "matmul") if isinstance(module, MatMulBase) else None


#: The forms a ``torch.nn`` activation class computes whatever its settings (``nn.GELU``'s ``approximate`` is read
#: at each call). Another class giving a form's values does so by its settings (``nn.LeakyReLU(0.0)``, ``nn.Hardtanh(0,
#: 1e9)``, ``nn.ELU(0.0)``: ReLU's), which a schedule or a configuration may change after convert.
_OWN_FORMS: dict[type, tuple[str, ...]] = {nn.ReLU: ("relu",), nn.GELU: ("gelu", "gelu_tanh"), nn.SiLU: ("silu",)}


def _rule_activation(module, cls):
    form = _probe_activation(module)
    base = None if written_in_model_code(cls) else _torch_base(cls)
    if form is not None and base is not None and form not in _OWN_FORMS.get(base, ()):
        # (converted, one whose slope was then set kept ReLU's gradient: a Linear's weight gradient at cosine 0.12
        # under "tempo" after Hardtanh's max_val was set, silently; a review, 2026-12-07)
        return Recognised(_FORM_KIND[form], reason=(
            f"an nn.{base.__name__} whose settings give {form}'s values: its settings decide what it computes, and "
            f"slimact's {form} would not follow them if they changed"))
    if form is not None and _reads_other_gradients(module, _PROBE.to(_params_of(module)[1])):
        return Recognised(_FORM_KIND[form], reason=_reads_other_reason(cls, f"a {form} activation"))
    if form is not None:
        # (writes_input: the module overwrites the tensor it is given, announced by `inplace` or not: an activation
        # whose forward calls F.relu(x, inplace=True) or x.relu_(); nn.activation routes it as an in-place one)
        return Recognised(_FORM_KIND[form], "activation", {"form": form, "writes_input": _writes_its_input(module)})
    return Recognised("activation") if _looks_like_activation(module) else None


#: Kinds slimact reports but has no replacement for (first match wins).
_REPORTED: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "linear"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.LayerNorm, "layernorm"),
    (nn.RMSNorm, "rmsnorm"),
    (nn.modules.batchnorm._BatchNorm, "batchnorm"),
    (nn.Softmax, "softmax"),
    (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding"),
    (nn.modules.loss._Loss, "loss"),
)


#: Class names that say attention without the word (timm's ``ClassAttn``/``TalkingHeadAttn`` in CaiT,
#: ``LocallyGroupedAttn`` in Twins, ``BottleneckAttn``, ConViT's ``MHSA``, a VQ-VAE's ``AttnBlock``); so do CBAM's
#: ``ChannelAttn`` and ResNeSt's ``SplitAttn``, which compute no scores: hence :func:`_computes_scores` too (or a
#: call of transformers' AttentionInterface: LongCat-Flash's multi-head latent attention, ``LongcatFlashMLA``).
_ATTN_NAME = re.compile(r"Attn(?![a-z])|MHSA|MHA(?![a-z])|MLA(?![a-z])")
#: Calls that multiply two tensors (with ``@``, the forms an attention's scores and output are written in).
_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum"})
#: ``@`` and ``@=`` in Python 3.10's bytecode (3.11 on: ``BINARY_OP`` with the operator as its argument).
_MATMUL_OPS = frozenset({"BINARY_MATRIX_MULTIPLY", "INPLACE_MATRIX_MULTIPLY"})


@functools.cache
def _forward_code(cls: type) -> tuple[frozenset[str], bool]:
    """The names ``cls``'s forward mentions (its nested functions' and comprehensions' included) and whether it
    multiplies two tensors (``@`` or a call in :data:`_PRODUCTS`)."""
    forward = next((c.__dict__["forward"] for c in cls.__mro__ if "forward" in c.__dict__), None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    codes = list(_codes_in(code)) if code is not None else []
    names = frozenset(n for c in codes for n in c.co_names)
    product = any(op.opname in _MATMUL_OPS or (op.opname == "BINARY_OP" and op.argrepr in ("@", "@="))
                  for c in codes for op in dis.get_instructions(c))
    return names, product or bool(names & _PRODUCTS)


def _computes_scores(cls: type) -> bool:
    """Whether ``cls``'s forward itself computes a softmax and a product of tensors: attention written in model
    code. Asked only of a class whose name says attention: on its own it would take whole models for attention
    (transformers' ``XLNetForQuestionAnswering`` weighs its hidden states by a softmax), and every product under them
    would be routed."""
    names, product = _forward_code(cls)
    return "softmax" in names and product


def scores_in_code(module: nn.Module) -> bool:
    """Whether ``module``'s forward computes a product of tensors and a softmax, its own or a ``nn.Softmax`` child's
    (vit-pytorch's ``LSA`` calls ``self.attend``): what summary names as attention it leaves as written where the
    class's name does not say attention."""
    names, product = _forward_code(_cls(module))
    return product and ("softmax" in names or any(
        isinstance(child, nn.Softmax) and attr in names for attr, child in module.named_children()))


def _rule_reported(module, cls):
    kind = next((k for base, k in _REPORTED if isinstance(module, base)), None)
    if kind is not None:
        return Recognised(kind)
    name = cls.__name__
    if ("Attention" in name or (_ATTN_NAME.search(name) and (_computes_scores(cls) or uses_attention_interface(module)))
            or "scaled_dot_product_attention" in forward_names(module)):
        # (a forward that calls F.scaled_dot_product_attention is attention whatever its class's name: timm's
        # ParallelScalingBlock, XCA, SimPool; its call was routed, and summary called the module "not covered". A
        # name saying attention in short, as LongCat-Flash's LongcatFlashMLA, counts with a call of transformers'
        # AttentionInterface too: it was left with no reason; not any module making that call, a decoder layer
        # writing its attention inline, whose Linears would then count as covered under "tempo", a review)
        return Recognised("attention")
    if name.endswith("LayerNorm"):
        return Recognised("layernorm")
    if name.endswith("RMSNorm"):
        return Recognised("rmsnorm")
    return None


#: TorchScript's names of the ``torch.nn`` classes a scripted module may have been, by the kind slimact would
#: have given them (so that ``summary`` lists a scripted Linear among the linears left alone).
_SCRIPTED_KINDS = {"Linear": "linear", "LayerNorm": "layernorm", "RMSNorm": "rmsnorm", "GroupNorm": "groupnorm",
                   "Conv1d": "conv", "Conv2d": "conv", "Conv3d": "conv", "GELU": "gelu", "SiLU": "silu",
                   "ReLU": "relu", "Softmax": "softmax", "Dropout": "dropout", "MultiheadAttention": "attention"}


def _rule_scripted(module, cls):
    """A TorchScript module (``torch.jit.script`` or ``trace``, and every module inside one): its compiled graph
    calls no Python ``forward`` or hook, so no replacement of it or of its children would run; left as written.
    (Probed as Python modules, the rules below crashed ``convert``: a scripted module's ``_modules`` is no dict.)"""
    if not isinstance(module, torch.jit.ScriptModule):
        return None
    kind = _SCRIPTED_KINDS.get(getattr(module, "original_name", ""), "other")
    return Recognised(kind, reason="a TorchScript module (torch.jit.script or trace): its compiled code calls no "
                      "Python module slimact could replace; left as written")


_PARAMETRIZATION = Recognised("other", reason="computes a parametrized weight (torch.nn.utils.parametrize), not an "
                              "activation of the model: left as written")


def _rule_parametrizations(module, cls):
    """A parametrized tensor's :class:`~torch.nn.utils.parametrize.ParametrizationList` and the modules in it (spectral
    norm's ``_SpectralNorm``, a user's ``forward(w)``): they compute a weight, not an activation, and are never
    probed (``_SpectralNorm``, a weightless module named Norm with an ``eps``, was probed as a hand-written norm: its
    power iteration on the probe resized its ``_u`` buffer and ``convert`` crashed for a 144-wide layer; a sweep).
    The list is recognised before its modules (``named_modules`` order): it notes them."""
    if not isinstance(module, parametrize.ParametrizationList):
        return None
    for m in module.modules():
        _cache[m] = _PARAMETRIZATION
    return _PARAMETRIZATION


#: The recogniser, in order: the first rule that answers decides.
_RULES: tuple[Callable[[nn.Module, type], Recognised | None], ...] = (
    _rule_parametrizations,
    _rule_scripted,
    _rule_gated_mlp,
    _rule_typed(nn.MultiheadAttention, "attention", "mha"),
    _rule_library_linear(_HF_CONV1D, "conv1d"),
    _rule_library_linear(_PYG_LINEAR, "pyg_linear"),
    _rule_typed(nn.Linear, "linear", "linear", _linear_unsupported),
    _rule_typed(nn.modules.conv._ConvNd, "conv", "conv", _conv_unsupported),
    _rule_typed(nn.modules.batchnorm._BatchNorm, "batchnorm", "batchnorm", _batch_norm_unsupported),
    _rule_group_norm,
    _rule_norm,
    _rule_typed(nn.Softmax, "softmax", "softmax"),
    _rule_matmul,
    _rule_exact(nn.Dropout, "dropout", "dropout"),
    _rule_activation,
    _rule_reported,
)


#: What every ``nn.Module`` holds in its ``__dict__`` (its tables and ``training``): no value a forward computes with.
_MODULE_TABLES = frozenset(nn.Module().__dict__)
#: Types a :func:`probed_state` compares by value (exactly these: a subclass, an enum of ints, by identity); anything
#: else by identity (:class:`_Same`).
_PLAIN_VALUES = frozenset((type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size))


class _Same:
    """An object a :func:`probed_state` compares by identity (a function, a config, a tensor with its version: one
    written in place moves). Held, not its ``id``: a deep copy or a pickle of the module maps it to the copy's."""

    __slots__ = ("obj", "version")

    def __init__(self, obj: object) -> None:
        self.obj = obj
        self.version = (0 if obj.is_inference() else obj._version) if issubclass(type(obj), Tensor) else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj and other.version == self.version

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self.obj).__name__} at {id(self.obj):#x}" + ("" if self.version is None else f" v{self.version}")

    def __getstate__(self) -> tuple:
        return self.obj, None  # (a copied tensor's version counter starts anew: taken again where it lands)

    def __setstate__(self, state: tuple) -> None:
        self.__init__(state[0])


def _value_key(value: object, depth: int = 0) -> object:
    """What of ``value`` a :func:`probed_state` compares: a plain value itself, a short tuple, list or dict its
    items', anything else its identity. (By ``type``, not ``isinstance``: a failed ``isinstance`` reads the object's
    ``__class__``, through a Hugging Face configuration's own ``__getattribute__``, 8 us each.)"""
    cls = type(value)
    if cls in _PLAIN_VALUES:
        return value
    if depth < 2 and (cls is tuple or cls is list) and len(value) <= 64:
        return (cls, tuple(_value_key(v, depth + 1) for v in value))
    if depth < 2 and cls is dict and len(value) <= 64:
        return (dict, tuple((k, _value_key(v, depth + 1)) for k, v in value.items()))
    return _Same(value)


def _code(value: object) -> Iterator[types.CodeType]:
    """The code objects of a class attribute: a function's (unwrapped), a static or class method's, a property's."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        yield from (f.__code__ for f in (value.fget, value.fset) if isinstance(f, types.FunctionType))
        return
    if callable(value):
        code = getattr(inspect.unwrap(value), "__code__", None)
        if isinstance(code, types.CodeType):
            yield code


def _names_in(code: types.CodeType) -> Iterator[str]:
    """The names ``code`` reads by name (attributes, globals) and its string constants (``getattr(self, "x")``),
    nested functions' and lambdas' included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, types.CodeType):
            yield from _names_in(const)


def _names_read_after_init(key: str, code: types.CodeType) -> Iterator[str]:
    """:func:`_names_in` of a class attribute's ``code``; of ``__init__``, only its nested functions' and lambdas',
    which may run later: what the constructor reads only while building (a Hugging Face MLP's
    ``config.hidden_act`` and ``config.intermediate_size``) is no value the forward computes with, and set after
    convert it sent a converted Llama's gated MLPs back to their own code (0.27x -> 0.61x of plain's bytes; a sweep,
    2026-12-07)."""
    if key != "__init__":
        yield from _names_in(code)
        return
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names_in(const)


_code_names: weakref.WeakKeyDictionary[type, tuple[tuple[str, ...], tuple[str, ...]]] = weakref.WeakKeyDictionary()


def _read_names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(instance names, class names)``: the attributes the code of ``cls`` and of its bases written in model code
    (not torch's, slimact's or Python's own) may read, those its code names (a function's attribute and global names,
    its string constants, those of every method it defines but the constructor, :func:`_names_read_after_init`);
    then, of them, the plain class attributes (``beta = 1.0`` in a class body). Read once per class."""
    found = _code_names.get(cls)
    if found is None:
        own = _model_code_classes(cls)
        names = dict.fromkeys(n for c in own for k, v in c.__dict__.items() for code in _code(v)
                              for n in _names_read_after_init(k, code)
                              if n not in _MODULE_TABLES and not n.startswith(("_slimact_", "__")))
        plain = tuple(n for n in names if any(n in c.__dict__ and (type(c.__dict__[n]) in _PLAIN_VALUES
                                                                   or type(c.__dict__[n]) is tuple) for c in own))
        found = _code_names[cls] = (tuple(names), plain)
    return found


#: An attribute the code names that the module does not hold (a global's name; an attribute set later).
_GONE = "<slimact: not set>"


class Probed(NamedTuple):
    """What :func:`probed_state` took of a module."""

    parts: tuple[str, ...]
    #: The keys (:func:`_value_key`) of the attributes its code names (:func:`_read_names`), then of its class's plain
    #: ones, then its parts'.
    values: tuple
    #: Children its replacement calls as modules, whatever they are (a fused gated MLP's gate and up projections: an
    #: adapter wrapping one after convert is called as it is): not watched.
    live: tuple[str, ...] = ()


def probed_state(module: nn.Module, parts: Iterable[str] = (), live: Iterable[str] = ()) -> Probed:
    """The values ``module``'s own code may read besides its parameters and buffers (its attributes and its class's
    plain attributes that the code names), and those of its children ``parts`` (the child itself, where a torch
    class's). A module written in model code is recognised by a probe of its forward with these values (a Swish's
    ``beta``, a muP multiplier of a gated MLP's output, a flag choosing its activation) and its replacement computes
    that form: where one has changed since (:func:`changed_since`), the replacement would compute another function
    than the module's code does. Attributes its code does not name (FSDP's ``_is_fsdp_managed_module``, set on every
    module it shards) are not taken."""
    parts, live = tuple(parts), tuple(live)
    return Probed(parts, _probed_values(module, parts, live), live)


_code_writes: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()
_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})


def _written_names(cls: type) -> frozenset[str]:
    """The global names the code of ``cls`` (and of its bases written in model code) assigns: state its code keeps for
    itself (a call counter, a warn-once flag), which moves at every call without changing the form it computes
    (watched, a counter sent an activation back to its own code from its second call on: a review). Not the
    attributes it assigns: a setter of the configuration's value (``self.cfg.beta = b``) must not hide its changes."""
    found = _code_writes.get(cls)
    if found is None:
        found = _code_writes[cls] = frozenset(
            ins.argval for c in _model_code_classes(cls) for k, v in c.__dict__.items() if k != "__init__"
            for code in _code(v) for inner in _codes_in(code) for ins in dis.get_instructions(inner)
            if ins.opname in _STORES)
    return found


def _model_code_classes(cls: type) -> list[type]:
    """``cls`` and its bases written in model code (not torch's, slimact's or Python's own)."""
    return [c for c in cls.__mro__ if not c.__module__.startswith(("torch.", "slimact.", "builtins"))]


def _codes_in(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes_in(const)


def _attributes(held: object, names: tuple[str, ...]) -> dict[str, object]:
    """Of ``names``, those ``held`` has and their values: its instance's (``__dict__`` or slots), else its class's
    plain values (a configuration class's defaults). Not through the object's own ``__getattribute__`` (a Hugging
    Face configuration's costs 8 us a read)."""
    try:
        attrs = object.__getattribute__(held, "__dict__")
    except AttributeError:
        attrs = {}
    found = {}
    for m in names:
        if m in attrs:
            found[m] = attrs[m]
            continue
        value = next((c.__dict__[m] for c in type(held).__mro__ if m in c.__dict__), _GONE)
        if isinstance(value, types.MemberDescriptorType):  # a slot: the instance's value, if set
            value = _slot_value(value, held)
        elif hasattr(value, "__get__") and not isinstance(value, (Tensor, *_PLAIN_VALUES)):
            value = _GONE  # a method or a property: code, not a value
        if value is not _GONE:
            found[m] = value
    return found


def _slot_value(slot: types.MemberDescriptorType, held: object) -> object:
    try:
        return slot.__get__(held, type(held))
    except AttributeError:  # (a slot never set)
        return _GONE


def _outside_values(cls: type, own: dict, names: tuple[str, ...]) -> tuple[tuple[str, object], ...]:
    """``((label, key), ...)``: what the code of ``cls`` may read outside the module, by the names it names: an
    attribute of an object the module holds, or of one that object holds (``self.cfg.beta``, ``self.cfg.act.beta``, a
    configuration's ``hidden_act``, its class's default; a plain value by value, a tensor by identity and version,
    anything else by identity; the object itself is compared by identity), and a plain global of the class's module
    (``BETA``) that its code does not assign (:func:`_written_names`). Changed after convert, the module computes
    another form than the one its probe saw (a review: a Swish's gradient at cosine 0.94, a gated MLP's forward 0.1
    off, where the object's identity and the module's own attributes had not moved)."""
    written = _written_names(cls)
    found: list[tuple[str, object]] = []

    def read(held: object, label: str, depth: int) -> None:
        for m, value in _attributes(held, names).items():
            if isinstance(value, (nn.Module, types.FunctionType, types.MethodType, types.ModuleType, type)):
                continue
            if isinstance(value, (numbers.Number, str, bytes)) and not isinstance(value, Tensor):
                found.append((f"{label}.{m}", value))  # (by value: a numpy scalar too)
            elif type(value) in _PLAIN_VALUES or isinstance(value, Tensor) or depth >= 1:
                found.append((f"{label}.{m}", _value_key(value)))
            else:
                read(value, f"{label}.{m}", depth + 1)

    for n in names:
        held = own.get(n)
        if held is None or type(held) in _PLAIN_VALUES or isinstance(
                held, (Tensor, nn.Module, types.FunctionType, types.MethodType, tuple, list, dict)):
            continue
        read(held, n, 0)
    scope = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
    found += [(n, scope[n]) for n in names
              if n not in own and n not in written and n in scope and type(scope[n]) in _PLAIN_VALUES]
    return tuple(found)


def _probed_values(module: nn.Module, parts: tuple[str, ...], live: tuple[str, ...] = ()) -> tuple:
    cls = _cls(module)
    names, plain = _read_names(cls)
    own = module.__dict__
    children = own["_modules"]
    values = tuple(_value_key(own[n]) if n in own else _child_key(children[n])
                   if n in children and n not in parts and n not in live else _GONE for n in names)
    values += tuple(_value_key(getattr(cls, n, _GONE)) for n in plain)
    values += (_outside_values(cls, own, names),)
    for part in parts:  # (a torch class's own, nn.GELU's approximate, the replacement reads live)
        child = own["_modules"].get(part)
        values += (_Same(child) if child is None or not written_in_model_code(_cls(child))
                   else _probed_values(child, ()),)
    return values


def _child_key(child: nn.Module | None) -> object:
    """What :func:`probed_state` compares of a child the module's code names besides its parts: the child itself,
    and what its forward reads, a torch class's settings (an ``nn.Dropout``'s ``p``). A gated MLP holding a dropout
    at ``p = 0`` when convert probed it was fused; the dropout set to 0.5 afterwards (a fine-tuning configuration)
    was then never applied: the forward 0.74 off, silently (a review, 2026-12-07)."""
    if child is None:
        return None
    if written_in_model_code(_cls(child)):
        return _Same(child), _probed_values(child, ())
    return _Same(child), tuple((k, v) for k, v in child.__dict__.items()
                               if type(v) in _PLAIN_VALUES and k != "training" and not k.startswith("_"))


def changed_since(module: nn.Module, probed: Probed) -> list[str] | None:
    """``None`` where ``module`` holds the values of ``probed`` (a few microseconds), else the names of those that
    changed (or came or went)."""
    now = _probed_values(module, probed.parts, probed.live)
    if now == probed.values:
        return None
    names, plain = _read_names(_cls(module))
    labels = (*names, *(f"{type(module).__name__}.{n}" for n in plain), "", *probed.parts)
    changed = []
    for n, a, b in zip(labels, now, probed.values, strict=False):
        if a != b and n:
            changed.append(n)
        elif a != b:  # (the values read outside the module: those that changed, came or went, by name)
            a, b = dict(a), dict(b)
            changed += [label for label in {**b, **a} if a.get(label, _GONE) != b.get(label, _GONE)]
    return changed


def as_probed(module: nn.Module, probed: Probed, holder: dict, what: str, runs: str) -> bool:
    """Whether ``module`` still holds the values of ``probed`` (:func:`changed_since`); where not, a warning (once per
    ``holder``, the ``__dict__`` of what computes the probed form) naming what changed: ``what`` was recognised with
    them, and ``runs`` as written while they differ."""
    changed = changed_since(module, probed)
    if changed is None:
        return True
    if not holder.get("_slimact_warned"):
        holder["_slimact_warned"] = True
        warnings.warn(f"slimact: {', '.join(changed)} of {_cls(module).__qualname__} changed since convert {what}: "
                      f"while it differs, {runs} as written, keeping what PyTorch keeps; slimact.convert(model) again "
                      "recognises it afresh", stacklevel=4)
    return False


def written_in_model_code(cls: type) -> bool:
    """Whether ``cls``'s forward is model code (recognised by a probe of it), not a ``torch.nn`` class's own."""
    base = _torch_base(cls)
    return base is None or cls.forward is not base.forward


def recognise(module: nn.Module) -> Recognised:
    """What ``module`` computes and which slimact replacement (if any) computes the same (cached per module)."""
    found = _cache.get(module)
    if found is None:
        cls = _cls(module)
        # Out of sight of selective activation checkpointing: a module first recognised in a checkpointed forward
        # (a deep copy of a converted model, whose cache is empty) probed there and not in the recompute, which
        # shifted the policy's count of each op, so the recompute got another op's kept output (tiny Llama's SiLU
        # kept: "The size of tensor a (2632) must match the size of tensor b (160)"; its products kept:
        # "aten.unsqueeze.default invocation index 4 ... not found in storage").
        # And out of inference mode (convert called under it): the probes' tensors need version counters and
        # gradients (a gated MLP was left unfused there, an activation's in-place probe raised).
        with unseen_by_selective_checkpointing(), torch.inference_mode(False):
            found = next((r for rule in _RULES if (r := rule(module, cls)) is not None), Recognised("other"))
        if found.replace is not None and "forward" in module.__dict__:
            # Its calls run the forward set on it (accelerate's hooks, `m.forward = ...`), which calls the class's
            # forward it was bound to, not a replacement's: converted, it kept plain's bytes and was counted.
            found = replace(found, replace=None, reason=(
                "a forward is set on the module itself (accelerate's hooks, `module.forward = ...`): its calls run "
                f"that, not slimact's {found.kind}"))
        _cache[module] = found
    return found


def forget(modules: Iterable[nn.Module]) -> None:
    """Drop what :func:`recognise` found for ``modules``: ``convert`` recognises afresh (an attribute such as a
    norm's ``eps`` or a GELU's ``approximate``, a hook or a child may have changed since the last time)."""
    for module in modules:
        _cache.pop(module, None)


def kind_of(module: nn.Module) -> str:
    """``"linear"``, ``"layernorm"``, ``"gelu"``, ``"attention"``, ... or ``"other"``."""
    kind = module.__dict__.get("_slimact_kind")
    return kind if kind is not None else recognise(module).kind
