"""PyTorch autograd features used around a converted model, under each policy, against the plain model (a deep copy
made before ``convert``, run with the same seed):

* activation checkpointing's recompute (``torch.utils.checkpoint`` non-reentrant, selective checkpointing as
  torchtitan applies it per block, ``checkpoint_sequential``, a whole checkpointed model) packs exactly what the
  forward packed: the same stochastic-rounding seeds, the same running estimate, updated once per step; a selective
  policy that keeps ops of slimact's own packs does not change them;
* module full backward hooks and backward pre-hooks (reading and rescaling ``grad_input``/``grad_output``) on
  converted modules and their parents, forward hooks and pre-hooks that replace a module's output or input, and one
  that modifies the output in place (``"tempo"`` keeps outputs: the op runs on a copy);
* saved-tensor hooks around the model (a counting and an offloading pair, nested with ``save_on_cpu``,
  ``disable_saved_tensors_hooks``): gradients as plain, and slimact still compressing under them;
* ``torch.func`` (``grad`` and ``vjp`` of ``functional_call``), forward-mode AD mixed with a backward;
* second order (a gradient penalty on the input, a Hessian-vector product): a clear error;
* ``no_grad``/``inference_mode``/``enable_grad`` nested in a forward, ``detach`` mid-model, inputs that need no
  gradient, and ``retain_graph=True``: a second backward of one graph doubles every gradient exactly.

Elsewhere: ``vmap(grad)`` per-sample gradients, ``jvp`` and forward AD (test_robustness, test_research), the gradient
penalty on parameters (test_research), ``create_graph`` per Function (functional/test_functions), ``save_on_cpu``
(test_integrations).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, checkpoint_sequential
from torch.utils.checkpoint import create_selective_checkpoint_contexts as selective

import slimact
from _harness import assert_gradients_close, assert_gradients_equal, estimates, tiny_hf

POLICIES = ["tempo", "int8", "mesa"]
_X = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(0))
_MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]


def _assert_like_plain(policy: str, want: dict, got: dict) -> None:
    """Lossless: equal to float rounding, normwise, as slimact.check judges it (slimact and PyTorch sum in other
    orders: about 1e-6 relative here, a few elements near zero off by more, elementwise); 8-bit: every gradient at
    cosine >= 0.99 (the library's floors)."""
    if policy == "tempo":
        assert_gradients_equal(want, got)
    else:
        assert_gradients_close(want, got)


def _assert_identical(policy: str, want: dict, got: dict) -> None:
    """A checkpointed step against the same model's without checkpointing: bit for bit under 8-bit policies (the
    recompute packs what the forward packed). Under "tempo", whose norms and activations keep their inputs, as
    PyTorch's, under checkpointing's saved-tensor hooks (functional._saving.foreign_saved_hooks), and their outputs
    without: equal to float rounding, as plain's."""
    if policy == "tempo":
        assert_gradients_equal(want, got)
        return
    assert want.keys() == got.keys() and want
    for name in want:
        assert torch.equal(got[name], want[name]), (name, ((got[name] - want[name]).norm() / want[name].norm()).item())


class _Block(nn.Module):
    """A pre-norm MLP block written partly in modules (converted) and partly in model code (routed)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        self.w = nn.Parameter(torch.ones(d))
        self.p = 0.1

    def forward(self, x):
        h = self.fc2(F.dropout(self.act(self.fc1(self.norm(x))), self.p, self.training))
        return x + F.silu(F.layer_norm(h, (h.shape[-1],), self.w))


class _Stack(nn.Module):
    def __init__(self, checkpointing: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 8)
        self.checkpointing = checkpointing

    def forward(self, x):
        how = self.checkpointing
        if how == "checkpoint_sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        else:
            for block in self.blocks:
                if how == "checkpoint":
                    x = checkpoint(block, x, use_reentrant=False)
                elif how is not None and how.startswith("selective"):
                    x = checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(selective, _SAC[how]))
                else:
                    x = block(x)
        return self.head(self.norm(x))


def _keep(ops):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


_SAC = {
    "selective, matmuls kept": _keep(_MATMULS),  # as torchtitan's per-block policy
    "selective, nothing kept": _keep(()),
    "selective, all recomputed": lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE,
    # Ops that also occur in a pack (its stochastic rounding's hash, its temporaries' views): not the model's own.
    "selective, arange kept": _keep([torch.ops.aten.arange.start]),
    "selective, views kept": _keep([torch.ops.aten.view.default, torch.ops.aten.slice.Tensor]),
}


def _stacks(policy: str) -> tuple[nn.Module, nn.Module]:
    """A seeded :class:`_Stack` and a copy of it converted with ``policy``."""
    torch.manual_seed(0)
    plain = _Stack()
    return plain, slimact.convert(copy.deepcopy(plain), policy)


def _step(model: nn.Module, x: torch.Tensor = _X, whole: bool = False, ctx=contextlib.nullcontext) -> dict:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(1)
    with ctx():
        out = checkpoint(model, x, use_reentrant=False) if whole else model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["input"] = x.grad
    return grads


# Activation checkpointing


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_sequential", "whole model", *_SAC])
def test_a_checkpointed_recompute_packs_what_the_forward_packed(how, policy):
    # The recompute of a checkpointed region ran its module calls as further call sites of the step under "mesa": a
    # second running estimate per module (started from the recomputed tensor; `_slimact_x_1_lo` buffers), other
    # stochastic-rounding seeds, and, for a whole checkpointed model, a step counted twice and its estimate folded
    # twice. Gradients then differed from the same model's without checkpointing by 0.5-1% relative (2% on tiny
    # Llama). A selective policy keeping ops that a pack also runs broke the pack: with a kept view of the rounding
    # temporary the recompute's codes were truncated with no noise (a Linear's dW biased by -4% of |dW| on average),
    # a kept arange gave other hash bits. Now the recompute's packs are the forward's, bit for bit, and the estimate
    # moves once per step.
    plain, slim = _stacks(policy)
    checkpointed = copy.deepcopy(slim)
    checkpointed.checkpointing = None if how == "whole model" else how
    for _ in range(2):  # (the second step packs with the estimate the first one left)
        want = _step(slim)
        _assert_identical(policy, want, _step(checkpointed, whole=how == "whole model"))
    assert estimates(slim).keys() == estimates(checkpointed).keys()
    for (name, b0), b1 in zip(estimates(slim).items(), estimates(checkpointed).values(), strict=True):
        assert torch.equal(b0, b1), name
    plain.checkpointing = checkpointed.checkpointing
    _assert_like_plain(policy, _step(plain, whole=how == "whole model"), want)


class _Headed(nn.Module):
    """A region whose first layer packs the region's own input (alive outside it) and whose later layers pack
    tensors made inside it: a Linear, a LayerNorm and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


class _Attending(nn.Module):
    """A region whose attention takes its own input as key and value, and a query made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.attention, self.out = nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.attention(x * 2 + 1, x, x, need_weights=False)[0])


class _Around(nn.Module):
    def __init__(self, region: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.checkpointing = region(), False

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False) if self.checkpointing else self.inner(x)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("region", [_Headed, _Attending], ids=["head", "attention"])
def test_a_recompute_reusing_its_inputs_pack_draws_the_seeds_the_forward_drew(region, policy):
    # The recompute reuses the forward's pack of the region's input (alive outside the region: the pack cache serves
    # it), where the forward drew that pack's stochastic-rounding seed: each later pack of the region took its
    # predecessor's seed, and under "mesa" the gradients differed from the same model's without checkpointing (the
    # head's weight by 2e-3 relative, the input's by 5e-3; equally close to plain's). Now bit for bit.
    slim = slimact.convert(_Around(region), policy)
    checkpointed = copy.deepcopy(slim)
    checkpointed.checkpointing = True
    for _ in range(2):
        _assert_identical(policy, _step(slim), _step(checkpointed))


_KEPT = {
    "matmuls": _MATMULS,  # torchtitan's per-block policy
    "activations": [torch.ops.aten.silu.default, torch.ops.aten.gelu.default, torch.ops.aten.tanh.default],
    "products": [torch.ops.aten.mul.Tensor],
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kept", list(_KEPT))
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_selective_checkpointing_of_hugging_face_blocks(name, kept, policy):
    # Per-block selective checkpointing (checkpoint_wrapper, as torchtitan applies it) of a deep copy of a converted
    # model: a step's gradients and the estimates left are those of the model without checkpointing. The copy
    # recognises its modules afresh, in its first (checkpointed) forward; the probes ran there and not in the
    # recompute, shifting the policy's count of each op: with Llama's SiLU or products kept, the recompute got
    # another op's kept output (a RuntimeError, "The size of tensor a (2632) must match ... (160)", or "invocation
    # index 4 ... not found in storage"; an output of the same shape would have been used silently).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain, inputs = tiny_hf(name)
    inputs["use_cache"] = False
    slim = slimact.convert(plain.train(), policy)
    checkpointed = copy.deepcopy(slim)
    blocks = checkpointed.transformer.h if name == "gpt2" else checkpointed.model.layers
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, context_fn=functools.partial(selective, _keep(_KEPT[kept])))

    def step(model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(**inputs).loss.backward()
        return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}

    for _ in range(2):
        _assert_identical(policy, step(slim), step(checkpointed))
    buffers = {n.replace("._checkpoint_wrapped_module", ""): b for n, b in estimates(checkpointed).items()}
    assert buffers.keys() == estimates(slim).keys()
    assert all(torch.equal(b, buffers[n]) for n, b in estimates(slim).items())


# Module hooks


def _record_and_rescale(seen: list):
    def hook(module, grad_input, grad_output):
        seen.append([g.clone() for g in (*grad_input, *grad_output) if g is not None])
        return tuple(None if g is None else 1.5 * g for g in grad_input)

    return hook


def _halve_grad_output(module, grad_output):
    return tuple(None if g is None else 0.5 * g for g in grad_output)


#: name -> installs hooks on a _Stack and returns the list they record into (grad_input and grad_output, per call).
_HOOKS = {
    "full backward hooks on converted modules": lambda m, seen: [
        mod.register_full_backward_hook(_record_and_rescale(seen))
        for mod in (m.blocks[0].act, m.blocks[0].norm, m.blocks[1].fc1, m.norm)],
    "full backward hooks on parents": lambda m, seen: [
        mod.register_full_backward_hook(_record_and_rescale(seen)) for mod in (m.blocks[0], m.blocks[1], m)],
    "full backward pre-hooks": lambda m, seen: [
        mod.register_full_backward_pre_hook(_halve_grad_output)
        for mod in (m.blocks[0].act, m.blocks[0].norm, m.blocks[1], m.head)],
    "forward hooks replacing the output": lambda m, seen: [
        m.blocks[0].act.register_forward_hook(lambda mod, args, out: 2 * out + 1),
        m.blocks[1].norm.register_forward_hook(lambda mod, args, out: out.tanh()),
        m.blocks[0].fc1.register_forward_hook(lambda mod, args, out: out - 0.1)],
    "forward pre-hooks replacing the input": lambda m, seen: [
        m.blocks[0].act.register_forward_pre_hook(lambda mod, args: (1.5 * args[0],)),
        m.blocks[1].norm.register_forward_pre_hook(lambda mod, args: (args[0] + 1,)),
        m.blocks[1].fc1.register_forward_pre_hook(lambda mod, args: (args[0].relu(),))],
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("hooks", list(_HOOKS))
def test_module_hooks_see_and_change_what_they_do_on_plain(hooks, policy):
    plain, slim = _stacks(policy)
    seen_plain, seen_slim = [], []
    _HOOKS[hooks](plain, seen_plain)
    _HOOKS[hooks](slim, seen_slim)
    _assert_like_plain(policy, _step(plain), _step(slim))
    assert len(seen_plain) == len(seen_slim)
    for want, got in zip(seen_plain, seen_slim, strict=True):  # what the hooks were handed
        _assert_like_plain(policy, dict(enumerate(want)), dict(enumerate(got)))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_backward_hooks_on_hugging_face_layers(name, policy):
    # Opacus/captum-style: full backward hooks reading and rescaling grad_input on a block, its attention, its MLP,
    # its norm, a projection and the activation (tempo's in-place GELU/SiLU and norms behind BackwardHookFunction).
    plain, inputs = tiny_hf(name)
    plain.train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    seen = {id(plain): [], id(slim): []}

    def step(model):
        block = (model.transformer.h if name == "gpt2" else model.model.layers)[0]
        mods = ([block.mlp.act, block.ln_1, block.mlp.c_fc, block.attn, block.mlp, block] if name == "gpt2" else
                [block.mlp.act_fn, block.input_layernorm, block.mlp.up_proj, block.self_attn, block.mlp, block])
        handles = [mod.register_full_backward_hook(_record_and_rescale(seen[id(model)])) for mod in mods]
        torch.manual_seed(1)
        model(**inputs).loss.backward()
        for handle in handles:
            handle.remove()
        return {n: p.grad for n, p in model.named_parameters()}

    with pytest.warns(UserWarning, match="no inputs require gradients") if name == "llama" else (
            contextlib.nullcontext()):
        want, got = step(plain), step(slim)
    _assert_like_plain(policy, want, got)
    assert len(seen[id(plain)]) == len(seen[id(slim)]) == 6


@pytest.mark.parametrize("policy", POLICIES)
def test_a_forward_hook_modifying_the_output_in_place(policy):
    # Plain PyTorch keeps the norm's input, so `out.mul_(2)` in a hook is fine there; "tempo" keeps the norm's output
    # (rebuilding the gradient from it), and the hook, run in the converted model's forward, moves the output to a copy
    # first (functional._saving.copy_on_write). 8-bit policies keep inputs. As plain under each.
    plain, slim = _stacks(policy)
    for model in (plain, slim):
        model.blocks[1].norm.register_forward_hook(lambda mod, args, out: out.mul_(2))
    _assert_like_plain(policy, _step(plain), _step(slim))


# Saved-tensor hooks


class _Counting:
    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self):
        def pack(t):
            self.bytes += t.numel() * t.element_size()
            return t.device, t.to("cpu", copy=True)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[1].to(packed[0]))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("hooks", ["counting", "counting inside save_on_cpu", "disable_saved_tensors_hooks"])
def test_saved_tensor_hooks_see_the_compressed_tensors(hooks, policy):
    plain, slim = _stacks(policy)
    counts = [_Counting(), _Counting()]

    def context(counting):
        if hooks == "disable_saved_tensors_hooks":
            return lambda: torch.autograd.graph.disable_saved_tensors_hooks("no hooks here")
        if hooks == "counting":
            return counting

        @contextlib.contextmanager
        def nested():
            with torch.autograd.graph.save_on_cpu(pin_memory=False), counting():
                yield

        return nested

    want, got = _step(plain, ctx=context(counts[0])), _step(slim, ctx=context(counts[1]))
    _assert_like_plain(policy, want, got)
    if hooks != "disable_saved_tensors_hooks":  # slimact's packs are what the hooks are handed
        assert 0 < counts[1].bytes < (0.7 if policy != "tempo" else 1.0) * counts[0].bytes


# torch.func and forward-mode AD


@pytest.mark.parametrize("policy", POLICIES)
def test_func_grad_vjp_and_forward_ad_with_a_backward(policy):
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, grad, vjp

    torch.manual_seed(0)
    plain = _Stack()
    for block in plain.blocks:
        block.p = 0.0  # (no dropout: the draws under torch.func and autograd differ)
    slim = slimact.convert(copy.deepcopy(plain), policy)

    def results(model):
        params = {k: v.detach() for k, v in model.named_parameters()}
        out = {f"grad {k}": g for k, g in grad(lambda p: functional_call(model, p, (_X,)).square().sum())(
            params).items()}
        y, pull = vjp(lambda p: functional_call(model, p, (_X,)), params)
        out.update({f"vjp {k}": g for k, g in pull(torch.ones_like(y))[0].items()})
        x = _X.clone().requires_grad_(True)
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(model(fwAD.make_dual(x, torch.ones_like(x))))
        primal.square().sum().backward()  # the graph of a dual forward's primal
        out["forward AD"], out["backward of a forward AD pass"] = tangent, x.grad
        return out

    want, got = results(plain), results(slim)
    for name in want:  # (slimact steps aside under both: PyTorch's own computation)
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


# Second order


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("what", ["gradient penalty on the input", "Hessian-vector product"])
def test_second_order_through_slimact_is_a_clear_error(what, policy):
    plain, slim = _stacks(policy)

    def second_order(model):
        x = _X.clone().requires_grad_(True)
        params = list(model.parameters())
        if what == "gradient penalty on the input":  # WGAN-GP / R1
            (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
            ((gx.norm(2, dim=-1) - 1) ** 2).mean().backward()
        else:
            grads = torch.autograd.grad(model(x).square().sum(), params, create_graph=True)
            torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])

    second_order(plain)
    with pytest.raises(RuntimeError, match=r"cannot be differentiated twice.*filter_fn"):
        second_order(slim)


# Grad modes, detach, retain_graph


class _TwoBranches(nn.Module):
    """A student stack and a frozen teacher branch run in the same forward in various grad modes."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student, self.teacher, self.mode = _Stack(), _Stack(), mode

    def forward(self, x):
        h = self.student.blocks[0](x)
        if self.mode == "no_grad":
            with torch.no_grad():
                t = self.teacher(x)
        elif self.mode == "inference_mode":
            with torch.inference_mode():
                t = self.teacher(x)
            t = t.clone()
        elif self.mode == "enable_grad inside no_grad":
            with torch.no_grad():
                a = self.teacher.blocks[0](x)
                with torch.enable_grad():
                    a = self.teacher.blocks[1](a)
            t = self.teacher.head(self.teacher.norm(a))
        else:  # detach mid-model: one branch sees a detached copy of the student's hidden state
            t = self.teacher(h.detach()) + self.teacher(h)
        return self.student.head(self.student.norm(self.student.blocks[1](h))) + t


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad inside no_grad", "detach"])
def test_grad_modes_nested_in_a_forward(mode, policy):
    plain = _TwoBranches(mode)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    _assert_like_plain(policy, _step(plain), _step(slim))


@pytest.mark.parametrize("policy", POLICIES)
def test_inputs_and_a_block_that_need_no_gradient(policy):
    torch.manual_seed(0)
    plain = _Stack()
    plain.blocks[0].requires_grad_(False)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    grads = []
    for model in (plain, slim):
        torch.manual_seed(1)
        model(_X).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    _assert_like_plain(policy, *grads)
    assert not any(n.startswith("blocks.0.") for n in grads[1])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["stack", "gpt2"])
def test_a_second_backward_of_the_same_graph_doubles_every_gradient(name, policy):
    if name == "gpt2":
        plain, inputs = tiny_hf("gpt2")
        plain.train()
    else:
        torch.manual_seed(0)
        plain, inputs = _Stack(), {"x": _X}
    slim = slimact.convert(copy.deepcopy(plain), policy)
    last = []
    for model in (plain, slim):
        torch.manual_seed(1)
        out = model(**inputs)
        loss = out.loss if name == "gpt2" else out.square().sum()
        loss.backward(retain_graph=True)
        once = {n: p.grad.clone() for n, p in model.named_parameters()}
        loss.backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, 2 * once[n], rtol=1e-6, atol=0, msg=n)
        last.append(once)
    _assert_like_plain(policy, *last)


def _run_in(how: str, model: nn.Module) -> dict:
    """One step of ``model`` on :data:`_X` in an autograd context ``how``."""
    model.zero_grad(set_to_none=True)
    x = _X.clone().requires_grad_(True)
    torch.manual_seed(1)
    handles = []
    if how == "global module hooks":
        from torch.nn.modules.module import register_module_forward_hook, register_module_full_backward_hook

        handles = [register_module_forward_hook(lambda m, args, out: 1.1 * out if isinstance(m, nn.Linear) else None),
                   register_module_full_backward_hook(lambda m, gi, go: None)]
    context = {"detect_anomaly": torch.autograd.detect_anomaly,
               "allow_mutation_on_saved_tensors, a hook changing a norm's output in place":
                   torch.autograd.graph.allow_mutation_on_saved_tensors}.get(how, contextlib.nullcontext)
    if how.startswith("allow_mutation"):
        handles = [model.blocks[1].norm.register_forward_hook(lambda mod, args, out: out.mul_(2))]
    try:
        with context():
            loss = model(x).square().sum()
            if how == "backward(inputs=...)":
                loss.backward(inputs=[x, model.blocks[0].fc1.weight, model.blocks[1].norm.weight])
            else:
                loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads["input"] = x.grad
    return grads


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["global module hooks", "detect_anomaly", "backward(inputs=...)",
                                 "allow_mutation_on_saved_tensors, a hook changing a norm's output in place"])
def test_other_autograd_contexts(how, policy):
    plain, slim = _stacks(policy)
    want, got = _run_in(how, plain), _run_in(how, slim)
    assert want.keys() == got.keys()
    _assert_like_plain(policy, want, got)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_second_backward_of_a_checkpointed_graph_doubles_every_gradient(policy):
    # Each backward recomputes the checkpointed blocks: the second recompute packs what the first (the forward) did.
    torch.manual_seed(0)
    slim = slimact.convert(_Stack("checkpoint"), policy)
    torch.manual_seed(1)
    loss = slim(_X).square().sum()
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in slim.named_parameters()}
    loss.backward()
    for n, p in slim.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], rtol=1e-6, atol=0, msg=n)


class _SharedBlockLoop(nn.Module):
    """ALBERT-style: one block applied at each depth, each application its own checkpointed region (optionally)."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head, self.checkpointed = _Block(), nn.Linear(32, 8), checkpointed

    def forward(self, x):
        for _ in range(3):
            x = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(x)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_shared_block_checkpointed_at_each_depth_and_accumulation_backward_in_reverse(policy):
    # Each region replays its own call site, estimate and seeds: a block called at three depths, each call its own
    # region, and two forwards whose backwards run in reverse order (the second forward moved the estimates before the
    # first region is recomputed) give the model's gradients without checkpointing bit for bit, estimates included.
    slim = slimact.convert(_SharedBlockLoop(), policy)
    checkpointed = copy.deepcopy(slim)
    checkpointed.checkpointed = True
    for _ in range(2):
        _assert_identical(policy, _step(slim), _step(checkpointed))
    got = []
    for model in (slim, checkpointed):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        first, second = model(_X).square().sum(), model(2 * _X).square().sum()
        second.backward()
        first.backward()
        got.append({n: p.grad.clone() for n, p in model.named_parameters()})
    _assert_identical(policy, *got)
    assert estimates(slim).keys() == estimates(checkpointed).keys()
    assert all(torch.equal(a, b) for a, b in zip(estimates(slim).values(), estimates(checkpointed).values(),
                                                 strict=True))


def test_a_reentrant_checkpoint_takes_the_call_sites_of_the_model_without_checkpointing():
    # A reentrant checkpoint runs its forward without grad (nothing packed) and packs in its recompute. The forward's
    # calls took call sites all the same, so the recompute's were further ones: a block shared over 12 depths had
    # estimates at sites 12-15, the last shared by 9 calls (blended, as before per-call-site estimates), its sites
    # 0-11 never set. Now a call under no_grad takes no site: the recompute takes the 12 sites the model without
    # checkpointing has, one estimate per call; it runs in reverse order (the last region first), so site k holds
    # the estimate of depth 11 - k, folded from the same tensors.
    slim = slimact.convert(_SharedBlockLoop(), "mesa")
    slim.block.p = 0.0
    reentrant = copy.deepcopy(slim)
    reentrant.forward = functools.partial(_reentrant_forward, reentrant, 12)
    slim.forward = functools.partial(_reentrant_forward, slim, 12, checkpointed=False)
    for _ in range(2):
        _step(slim)
        _step(reentrant)
    want, got = estimates(slim), estimates(reentrant)
    assert want and got.keys() == want.keys(), sorted(set(got) ^ set(want))
    def mirrored(name):  # (the head is called once, outside the loop)
        if not name.startswith("block."):
            return name
        stem, _, site = re.fullmatch(r"(.*_slimact_[a-z]+)(_(\d+))?_(lo|range)", name).group(1, 2, 3)
        k = 11 - int(site or 0)
        return f"{stem}{f'_{k}' if k else ''}_{name.rpartition('_')[2]}"

    for name, b in want.items():
        torch.testing.assert_close(got[mirrored(name)], b, rtol=1e-6, atol=1e-6, msg=name)
    # (A no_grad forward in training mode moves no estimate and takes no site.)
    with torch.no_grad():
        slim(_X)
    assert all(torch.equal(b, want[n]) for n, b in estimates(slim).items())


def _reentrant_forward(model: _SharedBlockLoop, depth: int, x, checkpointed: bool = True):
    for _ in range(depth):
        x = checkpoint(model.block, x, use_reentrant=True) if checkpointed else model.block(x)
    return model.head(x)


@pytest.mark.parametrize("policy", POLICIES)
def test_tensors_captured_by_forward_hooks_are_the_plain_ones_after_the_backward(policy):
    # Opacus/captum keep each layer's input and output from a forward hook (no copy) and read them in the backward:
    # no slimact layer writes into a tensor the plain layer leaves alone (a lossless layer keeps its output, it does
    # not overwrite its input).
    plain, slim = _stacks(policy)
    captured = []
    for model in (plain, slim):
        kept = {}
        for name, module in model.named_modules():
            if name and not list(module.children()):
                module.register_forward_hook(lambda m, args, out, name=name, kept=kept: kept.update(
                    {f"{name} in": args[0], f"{name} out": out}))
        _step(model)
        captured.append(kept)
    _assert_like_plain("tempo", *captured)  # (the forward is PyTorch's under every policy)


# Training-loop patterns


def _siamese(model: nn.Module) -> dict:
    x = _X.clone().requires_grad_(True)
    za, zb = model(x), model(2 * x.flip(1))
    (za * zb).sum().backward()
    return {"input": x.grad}


def _accumulated(model: nn.Module) -> dict:
    sum(model(k * _X).square().mean() for k in (1.0, 0.5, 2.0)).backward()
    return {}


def _adversarial(model: nn.Module) -> dict:
    model.eval()
    x = _X.clone().requires_grad_(True)
    model(x).square().sum().backward()
    model.train()
    model.zero_grad(set_to_none=True)
    model(_X + 0.1 * x.grad.sign()).square().sum().backward()
    return {"input (eval)": x.grad}


def _ema_teacher(model: nn.Module) -> dict:
    teacher = copy.deepcopy(model)
    for k in range(2):
        with torch.no_grad():
            target = teacher(_X + k)
        model.zero_grad(set_to_none=True)
        (model(_X) - target).square().sum().backward()
        with torch.no_grad():
            for t, p in zip(teacher.parameters(), model.parameters(), strict=True):
                t.lerp_(p - 0.1 * p.grad, 0.5)
    return {}


def _intermediates(model: nn.Module) -> dict:
    kept = {}
    handles = [mod.register_forward_hook(lambda m, args, out, name=name: kept.setdefault(name, out))
               for name, mod in (("norm", model.blocks[1].norm), ("gelu", model.blocks[0].act))]
    out = model(_X)
    for handle in handles:
        handle.remove()
    kept["norm"].retain_grad()
    kept["gelu"].register_hook(lambda g: g * torch.linspace(0.0, 2.0, g.shape[-1]))
    loss = out.square().sum() + kept["gelu"].sin().sum()
    (by_grad,) = torch.autograd.grad(loss, kept["gelu"], retain_graph=True)
    loss.backward()
    return {"norm output (retain_grad)": kept["norm"].grad, "gelu output (autograd.grad)": by_grad}


def _computed_weights(model: nn.Module) -> dict:
    from torch.func import functional_call

    params = dict(model.named_parameters())
    params["blocks.0.fc1.weight"] = 2 * params["blocks.0.fc1.weight"]
    params["blocks.1.norm.weight"] = params["blocks.1.norm.weight"] + 0.5
    functional_call(model, params, (_X,)).square().sum().backward()
    return {}


def _sgd(model: nn.Module) -> dict:
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for k in range(5):
        opt.zero_grad()
        torch.manual_seed(k)
        model(_X * (1 + k / 4)).square().mean().backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return {f"{n} moved": p.detach() - s for (n, p), s in zip(model.named_parameters(), start, strict=True)}


_LOOPS = {
    "one model on two inputs, one loss": _siamese,
    "three forwards, one backward": _accumulated,
    "an eval-mode input gradient, then a training step": _adversarial,
    "a no_grad EMA teacher between steps": _ema_teacher,
    "retain_grad, a tensor hook and autograd.grad at kept outputs": _intermediates,
    "functional_call with computed weights": _computed_weights,
    "5 SGD steps with momentum": _sgd,
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("loop", list(_LOOPS))
def test_training_loop_patterns_compute_what_plain_does(loop, policy):
    # Probed against plain (dropout drawn alike: the same seed before each loop): the gradients, or after the SGD steps
    # the parameters' moves, as plain's under each policy.
    plain, slim = _stacks(policy)
    results = []
    for model in (plain, slim):
        torch.manual_seed(1)
        extra = _LOOPS[loop](model)
        results.append({**{n: p.grad for n, p in model.named_parameters() if p.grad is not None}, **extra})
    _assert_like_plain(policy, *results)


class _DropoutAttention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.qkv, self.heads, self.p = nn.Linear(d, 3 * d), heads, p

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_batched_backward_through_attention_dropout_is_a_clear_error_and_runs_without_dropout(policy):
    # is_grads_batched (and jacobian(vectorize=True)) runs the backward in vmap mode, which refuses the redraw of the
    # dropout mask: PyTorch's "vmap: We do not yet support calling random operations inside of vmap" had been raised.
    torch.manual_seed(0)
    plain, x = _DropoutAttention(), torch.randn(2, 5, 32)
    model = slimact.convert(copy.deepcopy(plain), policy)
    out = model(x.clone().requires_grad_(True))
    eye = torch.eye(out.numel())[:4].reshape(4, *out.shape)
    with pytest.raises(RuntimeError, match=r"slimact's attention with dropout cannot run its backward batched"):
        torch.autograd.grad(out, model.qkv.weight, eye, is_grads_batched=True)
    # without dropout, a batched backward gives plain's gradients
    grads = []
    for m in (plain, model):
        m.p = 0.0
        (g,) = torch.autograd.grad(m(x), m.qkv.weight, eye, is_grads_batched=True)
        grads.append(g)
    for exact, approx in zip(*grads, strict=True):
        assert F.cosine_similarity(exact.flatten(), approx.flatten(), dim=0) > 0.999
