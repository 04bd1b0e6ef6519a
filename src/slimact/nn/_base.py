"""What every slimact module shares: how it is attached to (and detached from) a torch module.

A slimact module is the torch module it replaces with its class swapped for a subclass (``slimact.nn.Linear``
is an ``nn.Linear``): the object, its parameters and its ``state_dict`` stay the very same. What slimact adds
lives in plain attributes (the policy, the layer kind, the original class, the running estimates: not buffers,
:data:`slimact.quant.state.ESTIMATES_ATTR`), so checkpoints load both ways with ``strict=True``.

Running estimates are kept per **call site**: the ``k``-th call of a module within one step has its own estimate
(``_slimact_<operand>_lo`` for the first call, ``_slimact_<operand>_<k>_lo`` after), so a module applied twice per
step to tensors of very different ranges (a shared block, ``q @ k^T`` and ``p @ v`` through one MatMul) does not
average them. A step begins with each forward pass of the converted model (``convert`` counts them with a pre-hook on
the model) and with the first call after a backward pass that ran a slimact Function
(:func:`slimact.quant.state.backward_key`): a training loop that calls the model's submodules itself
(``model.head(model.encoder(x))``), or loops a converted block, keeps the sites the model's own forward keeps, and a
slimact module used on its own one site per call between two backward passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from slimact._kinds import as_probed, changed_since
from slimact.functional._saving import opaque, transformed
from slimact.policy import Policy, resolve
from slimact.quant import QuantConfig, RunningRange
from slimact.quant.recompute import checkpoint_frame, note, replayed
from slimact.quant.reference import COMPRESSIBLE_DTYPES, begin_stream, end_stream
from slimact.quant.state import ESTIMATES_ATTR, backward_key, few_rows

__all__ = [
    "MAX_CALL_SITES", "SlimModule", "StepCounter", "attach", "begin_call", "clear_state", "detach", "refuse_script",
    "site_estimate", "slim_class", "standalone",
]

#: Calls of one module per step that get their own running estimate; later calls share the last.
MAX_CALL_SITES = 16

_CLASS_CACHE: dict[tuple[type, type], type] = {}


class StepCounter:
    """Counts forward passes of a converted model (a forward pre-hook on the model) and brackets each with
    its stochastic-rounding seed stream (:func:`slimact.quant.reference.begin_stream`, which the count keys).

    One per converted model; ``value`` is saved and restored by :func:`slimact.state_dict` /
    :func:`slimact.load_state_dict`, so a resumed run draws the seeds the uninterrupted one would."""

    def __init__(self) -> None:
        self.value = 0
        self.active = 0  # forward passes of the model under way (nested: a model calling itself)
        self.backward = -1  # the backward the current pass began after (slimact.quant.state.backward_key)
        self.tentative: list[bool] = []  # per pass under way: begun without gradients, counted only if it packs

    def __call__(self, module: nn.Module, args: object) -> None:
        # Under torch.compile neither runs: the stream's key digests the RNG state on the host (a graph break),
        # and a counter read by the graph would recompile it every step. Compiled packs round to nearest
        # (:func:`slimact.quant.core._pack_traced`).
        if torch.compiler.is_compiling():
            return
        frame = checkpoint_frame()
        # (a checkpointed model's recompute is the same step, not another; a pass in eval mode, which packs nothing,
        # none: a validation loop between steps moved every later step's stochastic-rounding seeds. A pass begun
        # without gradients (generate() in train mode, an RL reference's log-probabilities with dropout on) draws
        # the next step's seeds but is counted only if it packed: one whose forward turns gradients on again does)
        counts = module.training and (frame is None or frame[1] is None)
        tentative = counts and not torch.is_grad_enabled()
        if counts and not tentative:
            self.value += 1
        if not self.active:  # (a backward in another thread, or inside this forward, does not split the pass)
            self.backward = backward_key()
        self.active += 1
        self.tentative.append(tentative)
        # (a tentative pass's own key, the next step's negated: a pass it makes with gradients on counts, and keys
        # its stream with that next step, which would have drawn the same seeds)
        begin_stream(-(self.value + 1) if tentative else self.value)

    def end(self, module: nn.Module, args: object, output: object) -> None:
        if not torch.compiler.is_compiling():
            self.active = max(self.active - 1, 0)
            drawn = end_stream()
            if self.tentative and self.tentative.pop() and drawn:
                self.value += 1

    def __getstate__(self) -> dict:
        return {"value": self.value}  # (a copy of the model is not in the middle of a pass)

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.value = state["value"]

    def key(self) -> tuple[int, int]:
        """The step of a call made now: this model's pass, and the backward it follows."""
        return self.value, (self.backward if self.active else backward_key())


def begin_call(module: nn.Module, running: bool = True) -> None:
    """Start a call of ``module`` that packs with running estimates: find its call site, the index of this call
    among the module's calls in the current step. A step is keyed by the forward passes of the converted model
    (``_slimact_steps`` counts those) and by the backward passes (:func:`slimact.quant.state.backward_key`), so calls
    made outside the model's forward (a training loop calling ``model.encoder(x)`` and then ``model.head(h)``, or
    looping a converted block to a data-dependent depth) start again at site 0 after each backward: before, with
    the pass count never moving, each step's calls took new sites, and from the 16th on all took the last, one
    estimate blended over every depth. A module called several times per step (ALBERT's shared layer, a block looped
    over depth, a tower applied to two views) then keeps one estimate per call, each tracking its own tensor's range,
    not one blend of them. Two forward passes of the model in one step (two views, MAML's inner and outer calls)
    are two steps here: their calls share sites.

    Under activation checkpointing, the recompute of a call takes the call site of the forward's call, not the next
    one (:mod:`slimact.quant.recompute`; :class:`RunningRange` then gives it the estimate that call found); a call
    that packs with no running estimate (``running=False``) notes nothing."""
    if torch.compiler.is_compiling():
        # A call dynamo traces takes no call site: a compiled pack uses no running estimate (docs/integrations.md),
        # and a site that moved while tracing was a guard that failed at the next call (a block shared over 3 depths
        # recompiled at every step, until dynamo's recompile limit sent its frames back to eager).
        return
    if not torch.is_grad_enabled():
        # Nor does a call that packs nothing: a reentrant checkpoint's forward runs without grad, and its recompute
        # (the calls that pack) then takes the sites the model without checkpointing has, not further ones (a block
        # shared over 12 depths reached the last site, 15, where 9 of its calls shared one estimate). Its step is
        # read all the same, so that the recompute is keyed as this step's calls.
        backward_key()
        return
    # Plain attributes written into __dict__ directly: nn.Module.__setattr__ first searches the module's
    # parameters, buffers and submodules for the name, on every call.
    d = module.__dict__
    frame = checkpoint_frame() if running else None
    if frame is not None and frame[1] is not None:
        site = replayed(*frame, ("site", module))
        if site is not None:
            d["_slimact_site"] = site
            return
    steps = d.get("_slimact_steps")
    step = (None, backward_key()) if steps is None else steps.key()
    if d.get("_slimact_step") != step:
        d["_slimact_step"] = step
        d["_slimact_site"] = 0
    else:
        d["_slimact_site"] = min(d["_slimact_site"] + 1, MAX_CALL_SITES - 1)
    if frame is not None:
        note(frame[0], ("site", module), d["_slimact_site"])


def site_estimate(module: nn.Module, operand: str) -> RunningRange:
    """The running estimate of ``operand`` at ``module``'s current call site (:func:`begin_call`)."""
    site = module.__dict__.get("_slimact_site", 0)
    return RunningRange(module, f"_slimact_{operand}" + (f"_{site}" if site else ""))


def refuse_script(what: str = "a model converted by slimact") -> nn.Module:
    """What ``torch.jit.script`` meets first in a converted model (``__prepare_scriptable__``: a slimact module's, and
    the converted root's, set on it by ``convert``, where only the calls in its code may be routed): a clear error
    where TorchScript failed on slimact's annotations or hooks ("'StepCounter' object has no attribute '__name__'")."""
    raise TypeError(
        f"{what}, which TorchScript cannot compile: script a plain copy, slimact.revert(copy.deepcopy(model)) (it "
        "computes what the converted model computes in eval mode), or use torch.export / torch.jit.trace, which run "
        "the converted model as PyTorch's own layers"
    )


def _warn_skipped_by_prepare_qat(module: SlimModule) -> None:
    """Warn once per module that ``torch.ao.quantization.prepare_qat`` (or ``prepare``), run after ``convert``, set
    its ``qconfig`` but skipped it: eager quantization maps modules by exact class, so a slimact subclass of a
    module it quantizes got no fake quantization or observer, and trains without them, silently otherwise."""
    if module.__dict__.get("_slimact_qat_warned"):
        return
    module.__dict__["_slimact_qat_warned"] = True
    from torch.ao.quantization.quantization_mappings import get_default_qconfig_propagation_list

    # (a dropout is listed but never observed: quantized, it is the identity)
    if (module._slimact_orig_cls in get_default_qconfig_propagation_list() and module._slimact_kind != "dropout"
            and "activation_post_process" not in module._modules):  # type: ignore[attr-defined]
        import warnings

        warnings.warn(
            f"a {module._slimact_orig_cls.__name__} slimact converted has a qconfig but no fake quantization or "
            "observer: torch.ao's eager quantization (prepare_qat, prepare) maps modules by exact class and skips "
            "slimact's when it runs after slimact.convert, so this one trains without quantization-aware training. "
            "Call prepare_qat before convert (or revert, prepare_qat, convert)", stacklevel=4)


#: Set on a converted module called in training under a transform slimact's Functions do not support
#: (:func:`~slimact.functional._saving.transformed`): summary's note.
TRANSFORMED_ATTR = "_slimact_transformed"


class SlimModule:
    """Mixin of every slimact module (``isinstance(m, SlimModule)`` tells a converted module)."""

    _slimact_policy: Policy
    _slimact_kind: str
    _slimact_orig_cls: type[nn.Module]
    _slimact_steps: StepCounter | None

    def _slimact_active(self, *inputs: Tensor) -> bool:
        """Compression only where a backward will need it (never in eval mode), and only of the dtypes it
        compresses: float64 (or integer) inputs run the module's own forward, exact, and so do nested and sparse
        tensors (:func:`~slimact.functional._saving.opaque`). A module whose work
        something else does for this call (``_slimact_deferred``: the LM head whose product the fused loss
        computes, :mod:`slimact.nn.lm_loss`) runs its own forward too, and so does a call under a ``torch.func``
        transform or forward-mode AD, which slimact's Functions do not support (:func:`transformed`)."""
        # (an instance made by calling a converted module's class, ``type(layer)(...)``, as a config clone or a
        # ``__deepcopy__`` rebuilding itself does, has no policy: it computes as its own class, where its first
        # training forward raised AttributeError: '_slimact_policy', a sweep)
        if not self.training or "_slimact_deferred" in self.__dict__ or "_slimact_policy" not in self.__dict__:
            return False
        if self.__dict__.get("qconfig") is not None:  # type: ignore[attr-defined]
            _warn_skipped_by_prepare_qat(self)
        for x in inputs:  # (a loop, not all() of a generator: this runs once per module call)
            if isinstance(x, Tensor) and (x.dtype not in COMPRESSIBLE_DTYPES or opaque(x)):
                return False
        if transformed():
            self.__dict__[TRANSFORMED_ATTR] = True  # (summary names where it stepped aside)
            return False
        return True

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script calls this on every submodule before compiling any; without it, scripting a converted
        # model failed on an annotation of slimact's ("Unknown type annotation: 'str'"). A plain copy returned here
        # would be written into the model's own _modules by PyTorch, reverting the user's model silently.
        refuse_script(f"{type(self).__qualname__} is a slimact module")

    def _slimact_one_input(self, args: tuple, kwargs: dict) -> bool:
        """:meth:`_slimact_active` for a call given its input alone, positionally. A call given more (Mamba2's gated
        RMSNorm, ``norm(x, gate)``: a module recognised by a probe then computes something else) or its input by
        keyword (``linear(input=x)``, ``norm(hidden_states=h)``: a name the module's own forward knows) runs the
        module's own code."""
        return len(args) == 1 and not kwargs and self._slimact_active(args[0]) and self._slimact_as_probed()

    def _slimact_as_probed(self) -> bool:
        """Whether a module written in model code still holds the values its forward was recognised with
        (:func:`slimact._kinds.probed_state`, taken by ``convert``): one set since (a Swish's ``beta`` scheduled, a
        muP multiplier of a gated MLP's output, a flag switching its activation) runs the module's own code, with
        a warning, where the replacement would compute the form probed (the gated MLP dropped the multiplier from
        its forward; the Swish differentiated the SiLU it was). Not checked under ``torch.compile``."""
        probed = self.__dict__.get("_slimact_probed")
        return probed is None or torch.compiler.is_compiling() or as_probed(
            self, probed, self.__dict__, "recognised what its forward computes", "the module runs its own code")  # type: ignore[arg-type]

    def _slimact_changed(self) -> list[str] | None:
        """What :meth:`_slimact_as_probed` finds changed since convert (no warning; ``summary`` lists the module as
        running its own code), else ``None``."""
        probed = self.__dict__.get("_slimact_probed")
        return None if probed is None else changed_since(self, probed)  # type: ignore[arg-type]

    def _slimact_begin(self) -> None:
        """Start a call: find its call site (for running estimates)."""
        begin_call(self, self._slimact_running())  # type: ignore[arg-type]

    def _slimact_running(self) -> bool:
        return self._slimact_policy.settings(self._slimact_kind).scale == "running"

    def _slimact_cfg(self, x: Tensor) -> QuantConfig:
        cfg = self._slimact_policy.quant_config(self._slimact_kind, x.dim())
        if (cfg is not None and cfg.scale == "running" and cfg.group_dim is not None and x.dim()
                and few_rows(x.numel(), x.shape[cfg.group_dim % x.dim()])):
            # (a layer's few rows a channel, a diffusion model's timestep MLP at batch 2: its own range;
            # slimact.quant.state.few_rows. Conditioned diffusers models failed check under "mesa" there)
            return dataclasses.replace(cfg, scale="dynamic")
        return cfg

    def _slimact_state(self, operand: str = "x") -> RunningRange | None:
        """The running estimate of ``operand`` at this call site, if the policy uses running estimates."""
        if not self._slimact_running():
            return None
        return site_estimate(self, operand)  # type: ignore[arg-type]

    def __reduce_ex__(self, protocol):
        # A class made by slim_class exists only in the process that made it: pickle (torch.save,
        # deepcopy) the module as its mixin and its original class, rebuild the class on load, then give it its
        # state. The state is the reduce tuple's third item, not an argument of _rebuild: deepcopy and pickle
        # then record the new module before copying its state, so a state that refers back to the module (a hook
        # bound to it, a child holding its parent) finds it, where as an argument it recursed without end.
        cls = type(self)
        if getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls:
            return super().__reduce_ex__(protocol)
        return _rebuild, (cls.__bases__[0], original_class(self)), self.__getstate__()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        loaded = getattr(self, "_slimact_loaded", None)
        if loaded is not None:  # (state a slimact from before it did not keep)
            loaded()

    def extra_repr(self) -> str:
        p = self._slimact_policy
        slim = f"slimact: {self._slimact_kind}, policy {p.name!r}"
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, {slim}" if base else slim


def _rebuild(mixin: type, cls: type[nn.Module], state: dict | None = None) -> nn.Module:
    """The module of class ``slim_class(mixin, cls)``, without its state (pickle and deepcopy set it next); with
    ``state``, as a module pickled by a slimact before the state was the reduce tuple's own item, with it."""
    if "transformers" in sys.modules:  # a converted Hugging Face model being loaded: its attention name too
        from slimact.attention import register

        register()
    module = cls.__new__(cls)
    module.__class__ = slim_class(mixin, cls)
    if state is not None:
        module.__setstate__(state)
    return module


def slim_class(mixin: type, cls: type[nn.Module]) -> type[nn.Module]:
    """The slimact subclass of ``cls`` that adds ``mixin``'s forward (one class per pair, cached)."""
    key = (mixin, cls)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(cls.__name__, (mixin, cls), {"__module__": mixin.__module__})
    return _CLASS_CACHE[key]


def clear_state(module: nn.Module) -> None:
    """Drop the running estimates of ``module``."""
    module.__dict__.pop(ESTIMATES_ATTR, None)


def attach(
    module: nn.Module,
    slim_cls: type[nn.Module],
    policy: Policy,
    kind: str,
    steps: StepCounter | None = None,
    **extra: Any,
) -> nn.Module:
    """Turn ``module`` into an instance of ``slim_cls`` in place (idempotent: re-attaching updates the policy).

    ``extra`` items become ``_slimact_<name>`` attributes (e.g. an activation's form). Changing the policy
    drops the running estimates gathered under the old one.
    """
    if not isinstance(module, SlimModule):
        module._slimact_orig_cls = type(module)
        module.__class__ = slim_cls
    elif module.__dict__.get("_slimact_policy") != policy:
        clear_state(module)
    module._slimact_policy = policy
    module._slimact_kind = kind
    module._slimact_steps = steps
    for name, value in extra.items():
        setattr(module, f"_slimact_{name}", value)
    return module


def _unslimmed_class(cls: type[nn.Module], orig: type[nn.Module]) -> type[nn.Module]:
    """The class a converted module returns to: ``orig``, or, where a class was derived from the slimact
    class after ``convert`` (``torch.nn.utils.parametrize`` makes ``Parametrized<Class>`` with the
    parametrised tensors as properties), the same derived class rebuilt on ``orig``."""
    slim = next(c for c in cls.__mro__ if c.__module__.startswith("slimact.") and issubclass(c, SlimModule))
    if cls is slim:
        return orig
    if cls.__bases__ != (slim,):
        raise RuntimeError(
            f"cannot revert {cls.__qualname__}: it derives from slimact's {slim.__qualname__} through "
            f"{[b.__qualname__ for b in cls.__bases__]}, which slimact cannot rebuild on {orig.__qualname__}"
        )
    body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (orig,), body)


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before :func:`attach`; for an instance made by calling a converted module's class
    (which ``attach`` never saw), the class slimact's was made from (its last base: ``(mixin, original)``)."""
    return module.__dict__.get("_slimact_orig_cls") or type(module).__bases__[-1]


def detach(module: nn.Module) -> nn.Module:
    """Undo :func:`attach`: the original class again, slimact's attributes and estimates gone."""
    if not isinstance(module, SlimModule):
        return module
    clear_state(module)
    module.__class__ = _unslimmed_class(type(module), original_class(module))
    for name in [n for n in module.__dict__ if n.startswith("_slimact_") and not n.startswith("_slimact_root")]:
        del module.__dict__[name]
    return module


@contextlib.contextmanager
def as_written(model: nn.Module) -> Iterator[None]:
    """``model``'s converted modules in their original classes for the duration, everything else (their state
    included) as it is: what a probe of a parent's forward must see to recognise the parent as on the plain model
    (a gated MLP whose parts compute slimact's 8-bit forms has other gradients than the exact form's)."""
    swapped = []
    try:
        for module in model.modules():
            if isinstance(module, SlimModule):
                try:
                    plain = _unslimmed_class(type(module), original_class(module))
                except RuntimeError:  # (a class derived from slimact's that revert cannot rebuild either: kept)
                    continue
                swapped.append((module, type(module)))
                module.__class__ = plain
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def standalone(mixin: type, base: type[nn.Module], kind: str, name: str, doc: str, **extra: Any) -> type[nn.Module]:
    """A named slimact class for direct use: ``base``'s constructor plus a keyword-only ``policy``.

    ``extra`` maps attribute names to functions of the constructed module (e.g. its activation form).
    """

    def __init__(self, *args: Any, policy: str | Policy = "int8", **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self._slimact_orig_cls = base
        attach(self, cls, resolve(policy), kind, **{k: f(self) for k, f in extra.items()})

    cls = type(name, (mixin, base), {"__init__": __init__, "__doc__": doc, "__module__": mixin.__module__})
    return cls
