import contextlib
import copy
import sys
import warnings
from collections import Counter

import pytest
import torch
from torch import nn

import _nano
import slimact
from _harness import HandWrittenAttention, estimates
from slimact._metrics import cosine
from slimact.nn import SlimModule
from slimact.policy import KINDS


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 32), Block(), Block(), nn.Linear(32, 50))


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


IDS = torch.randint(0, 50, (4, 16))


def test_keeps_the_same_parameter_objects_and_state_dict():
    model = _model()
    params = list(model.parameters())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert slimact.convert(model) is model
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    after = model.state_dict()
    assert list(after) == list(sd)
    for k in sd:
        assert torch.equal(after[k], sd[k]) and after[k].data_ptr() == ptrs[k]
    _step(model, IDS)  # a training step adds running state, never state_dict entries
    assert list(model.state_dict()) == list(sd)


def test_checkpoints_load_both_ways_strict():
    plain, converted = _model(), slimact.convert(_model(), "mesa")
    _step(converted, IDS)
    converted.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(converted.state_dict(), strict=True)


def test_replaced_modules_subclass_originals():
    model = slimact.convert(_model())
    fc = model[1].fc1
    assert isinstance(fc, nn.Linear) and isinstance(fc, slimact.nn.Linear) and isinstance(fc, SlimModule)
    assert type(model[0]) is nn.Embedding


def test_converted_forward_is_exact_and_grads_close():
    model = _model()
    out0, g0 = _step(model, IDS)
    slimact.convert(model)
    out1, g1 = _step(model, IDS)
    assert torch.equal(out0, out1)
    for name in g0:
        assert cosine(g0[name], g1[name]) >= 0.999, name


def test_revert_restores_exact_outputs_and_gradients():
    model = _model()
    out0, g0 = _step(model, IDS)
    classes = [type(m) for m in model.modules()]
    slimact.convert(model, "mesa")
    _step(model, IDS)
    slimact.revert(model)
    assert [type(m) for m in model.modules()] == classes
    assert not any(n.startswith("_slimact") for m in model.modules() for n in vars(m))
    assert not estimates(model)
    out1, g1 = _step(model, IDS)
    assert torch.equal(out0, out1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_a_block_copied_alone_shares_the_models_routing_and_copies_nothing_else():
    # A block's hooks, deep-copied with it (an EMA of a backbone, peft's modules_to_save), took a copy of slimact's
    # routing, and with it everything the routing holds: GPT-2's LM head (its weight, the vocabulary's rows: 6,144
    # parameters more than the block's own 49,984 at the zoo's test size, 38.6M at GPT-2's).
    from slimact import zoo
    from slimact.nn.routing import Routing

    model = slimact.convert(zoo.build("gpt2", tiny=True).train(), "int8")
    memo: dict = {}
    block = copy.deepcopy(model.transformer.h[0], memo)
    copied = [o for o in memo.values() if isinstance(o, nn.Parameter)]  # (every object the copy made)
    assert sum(p.numel() for p in copied) == sum(p.numel() for p in block.parameters())
    owners = {id(h.__self__) for m in block.modules() for h in m._forward_pre_hooks.values()
              if isinstance(getattr(h, "__self__", None), Routing)}
    assert owners == {id(model.__dict__["_slimact_root_routing"])}
    whole = copy.deepcopy(model)  # (a copy of the whole model has a routing of its own)
    assert whole.__dict__["_slimact_root_routing"] is not model.__dict__["_slimact_root_routing"]
    # A copy that reaches a block before the model (a list, a wrapper holding the blocks first): the block's copy is
    # the copied model's, routed by the copy's routing (it was the original's, so its attention ran as written).
    for copied in (copy.deepcopy([model.transformer.h[0], model])[1], _copied_through_a_back_reference(model)):
        owners = {id(h.__self__) for m in copied.modules() for h in m._forward_pre_hooks.values()
                  if isinstance(getattr(h, "__self__", None), Routing)}
        assert owners == {id(copied.__dict__["_slimact_root_routing"])}


def _copied_through_a_back_reference(model: nn.Module) -> nn.Module:
    """A copy of ``model`` made by copying its first block, which holds a plain reference to the model: the block's
    hooks are copied before the model is reached (two stayed bound to the original routing; a helper's review)."""
    model.transformer.h[0].__dict__["owner"] = model
    try:
        return copy.deepcopy(model.transformer.h[0]).owner
    finally:
        del model.transformer.h[0].__dict__["owner"]


def test_revert_makes_a_module_plain_in_every_model_holding_it():
    # revert restores a module's class, which is its own in every model holding it; the hooks another converted model
    # left on it then routed its calls, half converted, and so did those of a block loaded with its converted model
    # and put into a plain one (514,212 bytes kept where plain keeps 579,460; helpers' reviews).
    import io

    from slimact import zoo
    from slimact.nn.routing import Routing

    def routings_on(module):
        return [h for m in module.modules() for h in m._forward_pre_hooks.values()
                if isinstance(getattr(h, "__self__", None), Routing)]

    m1, m2 = zoo.build("gpt2", tiny=True), zoo.build("gpt2", tiny=True)
    m2.transformer.h[0] = m1.transformer.h[0]
    slimact.convert(m1, "int8")
    slimact.convert(m2, "int8")
    slimact.revert(m1)
    assert not routings_on(m2.transformer.h[0]) and routings_on(m2.transformer.h[1])  # (the rest of m2 converted)
    buffer = io.BytesIO()
    torch.save(slimact.convert(zoo.build("gpt2", tiny=True), "int8"), buffer)
    host = zoo.build("gpt2", tiny=True)
    host.transformer.h[0] = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False).transformer.h[0]
    slimact.revert(host)
    assert not routings_on(host) and not [m for m in host.modules() if isinstance(m, SlimModule)]
    plain = zoo.build("gpt2", tiny=True)
    plain.load_state_dict(host.state_dict())
    inputs = zoo.example_inputs(plain, 2, 16)
    assert slimact.profile(host, inputs).activation_bytes == slimact.profile(plain, inputs).activation_bytes


def test_summary_of_a_model_not_converted_says_convert_replaces_its_layers():
    # It said "no slimact replacement yet" of every Linear, GELU and LayerNorm of a model never converted, or reverted.
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4), nn.Embedding(3, 4))
    for found in (slimact.summary(model), slimact.summary(slimact.revert(slimact.convert(model)))):
        assert all(found.skipped[n].startswith("not converted: the model was not converted") for n in ("0", "1", "2"))
        assert found.skipped["3"].startswith("no slimact replacement yet for Embedding")


def test_summary_names_what_the_routed_linear_kind_routes():
    # "routed in model code ...: linear" read as if F.linear in model code were routed (torchtune's LoRA layers and
    # tied head keep their fp32 inputs through it): it is torch._grouped_mm, MoE experts' products, only.
    text = str(slimact.summary(slimact.convert(nn.Sequential(nn.Linear(4, 4)), "int8")))
    routed = next(line for line in text.splitlines() if line.startswith("routed in model code"))
    assert "linear (torch._grouped_mm only)" in routed and "product (of an activation's output)" in routed


def test_summary_of_a_model_holding_a_converted_module_is_that_modules_and_lists_the_rest():
    # A model holding a converted module (a block converted on its own; a head added to a converted backbone, peft's
    # prompt encoder beside the model it wraps) read "policy: none: model not converted" above the count of converted
    # modules, and called the modules outside "no slimact replacement yet" (helpers' reviews).
    from slimact import zoo

    model = zoo.build("gpt2", tiny=True).train()
    slimact.convert(model.transformer.h[0], "int8")
    found = slimact.summary(model)
    assert found.policy == "int8" and "converted as transformer.h.0" in str(found)
    assert found.modules["transformer.h.0.attn.c_attn"] == "linear"
    assert "outside transformer.h.0" in found.skipped["transformer.h.1.attn.c_attn"]
    assert not [r for r in found.skipped.values() if "after convert" in r or "no slimact replacement" in r]
    backbone = slimact.convert(zoo.build("gpt2", tiny=True).transformer, "int8")
    with_head = nn.Sequential(backbone, nn.Linear(64, 3))
    found = slimact.summary(with_head)
    assert found.policy == "int8" and "outside 0" in found.skipped["1"] and found.functional
    both = zoo.build("gpt2", tiny=True)  # two blocks converted each on its own: both summaries, merged
    slimact.convert(both.transformer.h[0], "int8")
    slimact.convert(both.transformer.h[1], "tempo")
    found = slimact.summary(both)
    assert found.policy == "int8, tempo" and found.modules["transformer.h.1.ln_1"] == "layernorm"
    assert found.converted == dict(Counter(found.modules.values()))
    assert "outside transformer.h.0, transformer.h.1" in found.skipped["transformer.wte"]


def test_idempotent():
    model = _model()
    slimact.convert(model)
    classes = [type(m) for m in model.modules()]
    slimact.convert(model)
    assert [type(m) for m in model.modules()] == classes
    slimact.convert(model, "mesa")  # another policy re-applies to the same classes
    assert [type(m) for m in model.modules()] == classes
    assert model[1].fc1._slimact_policy.scale == "running"
    slimact.convert(model, "int8")
    assert model[1].fc1._slimact_policy.scale == "dynamic"
    assert "_slimact_x_lo" not in estimates(model[1].fc1)


def test_filter_fn_and_patterns_exclude_modules():
    model = slimact.convert(_model(), filter_fn=lambda m, name: name != "3")
    assert not isinstance(model[3], SlimModule) and isinstance(model[1].fc1, SlimModule)
    s = slimact.summary(model)
    assert s.skipped["3"] == "excluded by filter_fn"
    model = slimact.convert(_model(), slimact.Policy(exclude=("*.fc2",)))
    assert not isinstance(model[1].fc2, SlimModule) and isinstance(model[1].fc1, SlimModule)


class _GatedMLP(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x)), which slimact fuses (its down projection and activation computed
    by the block itself)."""

    def __init__(self, d=16, f=48):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("how", ["filter_fn", "pattern"])
@pytest.mark.parametrize("part", ["down_proj", "act_fn"])
def test_a_part_of_a_fused_block_excluded_by_name_stays_exact(part, how):
    # The fused gated MLP computes its down projection and activation itself: excluding one of them (filter_fn, a
    # policy exclude pattern) changed nothing, their tensors were kept 8-bit all the same (down_proj's weight
    # gradient at a relative 1e-2), and the summary said "computed by its parent". The block now stays as written.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), _GatedMLP())
    kwargs = ({"filter_fn": lambda m, name: not name.endswith(part)} if how == "filter_fn"
              else {"policy": slimact.Policy(exclude=(f"*.{part}",))})
    slim = slimact.convert(copy.deepcopy(plain), **kwargs)
    assert not isinstance(slim[1], SlimModule) and not isinstance(getattr(slim[1], part), SlimModule)
    assert isinstance(slim[1].gate_proj, SlimModule) and isinstance(slim[1].up_proj, SlimModule)
    s = slimact.summary(slim)
    assert part in s.skipped["1"] and s.modules.get("1") != "mlp"
    x = torch.randn(4, 7, 16)
    grads = []
    for model in (plain, slim):
        model.zero_grad()
        torch.manual_seed(1)
        model(x).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    if part == "down_proj":  # the last layer, its input kept exact: its gradients are plain's
        for n in ("1.down_proj.weight", "1.down_proj.bias"):
            torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)
    for n, g in grads[0].items():
        assert cosine(g, grads[1][n]) >= 0.99, n


@pytest.mark.parametrize("first", [slimact.Policy(kinds=tuple(k for k in KINDS if k != "mlp")),
                                   slimact.Policy(exclude_index=("mlp:0",))], ids=["mlp-kind-off", "mlp-excluded"])
def test_converting_again_fuses_a_gated_mlp_whose_parts_the_first_policy_converted(first):
    # A first policy that left the gated MLP unfused converted its projections and activation on their own; converting
    # again with "int8" then probed the block with those parts computing slimact's 8-bit forms, whose gradients are
    # not the exact form's, so the block was not recognised: it stayed unfused (tiny Llama: both MLPs, the summary
    # naming down_proj and act_fn converted on their own, gradients other than a fresh "int8" conversion's).
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), _GatedMLP())
    twice = slimact.convert(slimact.convert(copy.deepcopy(plain), first), "int8")
    once = slimact.convert(copy.deepcopy(plain), "int8")
    assert slimact.summary(once).modules["1"] == "mlp"
    assert slimact.summary(twice).modules == slimact.summary(once).modules
    assert [type(m) for m in twice.modules()] == [type(m) for m in once.modules()]
    x = torch.randn(4, 7, 16)
    grads = []
    for model in (twice, once):
        torch.manual_seed(1)
        model(x).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[1].items():
        assert torch.equal(grads[0][n], g), n


def test_exclude_index_counts_every_module_of_its_kind_in_model_order_fused_parts_included():
    # "linear:i" is the i-th Linear in named_modules() order (Policy's docstring, Mesa's by_index). A gated MLP's down
    # projection, computed by the fused block, was not counted: on nn.Sequential(Linear, gated MLP, Linear) "linear:3"
    # (the MLP's down_proj) excluded the last Linear instead, and the numbering moved with the policy's mlp kind.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), _GatedMLP(), nn.Linear(16, 16))
    linears = [n for n, m in plain.named_modules() if isinstance(m, nn.Linear)]
    assert linears == ["0", "1.gate_proj", "1.up_proj", "1.down_proj", "2"]
    for kinds in (KINDS, tuple(k for k in KINDS if k != "mlp")):
        slim = slimact.convert(copy.deepcopy(plain), slimact.Policy(kinds=kinds, exclude_index=("linear:3",)))
        s = slimact.summary(slim)
        assert s.skipped["1.down_proj"] == "excluded by index (linear:3)", kinds
        assert type(slim[1].down_proj) is nn.Linear and s.modules["2"] == "linear"
        assert s.modules.get("1") != "mlp" and s.modules["1.gate_proj"] == "linear"  # (left unfused, as by name)


def test_summary_reports_converted_and_left_alone():
    model = slimact.convert(_model())
    s = slimact.summary(model)
    assert s.converted == {"linear": 5, "layernorm": 2, "gelu": 2, "dropout": 2}
    assert "Embedding" in s.skipped["0"]
    text = str(s)
    assert "policy: int8" in text and "linear" in text and "Embedding" in text
    assert slimact.summary(_model()).policy is None


class _InplaceDropout(nn.Dropout):
    def forward(self, x):
        return nn.functional.dropout(x, self.p, self.training, self.inplace)


class _SummaryOddCases(nn.Module):
    """A LayerNorm over its last two dims and an in-place dropout of its own: their code calls F.layer_norm and
    F.dropout, which the routes decline there (more than the last dim; in place)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(16, 16), nn.LayerNorm([8, 16]), _InplaceDropout(0.1, inplace=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.drop(self.norm(self.lin(x))))


def test_summary_does_not_report_converted_a_module_whose_call_the_route_declines():
    # summary reported nn.LayerNorm([8, 16]) and the in-place dropout converted (their code calls F.layer_norm and
    # F.dropout, routed functions) and dropped the norm's reason, while both ran as written: the norm kept its
    # [2, 8, 16] fp32 input.
    model = slimact.convert(_SummaryOddCases(), "int8")
    s = slimact.summary(model)
    assert "norm" not in s.modules and "drop" not in s.modules, s.modules
    assert "more than the last dim" in s.skipped["norm"] and "drop" in s.skipped
    kept = {(e.module, e.dtype) for e in slimact.profile(model, torch.randn(2, 8, 16)).entries
            if e.shape == (2, 8, 16)}
    assert ("norm", torch.float32) in kept, kept  # as written, as the summary now says


def test_an_in_place_dropout_module_is_reported_left_as_written():
    # torchvision's EfficientNet and MobileNetV3 heads: nn.Dropout(inplace=True) runs PyTorch's own dropout (the
    # replacement's forward declines in place), which summary had counted converted, its bytes blamed on ops "left
    # as written in its code (a tanh soft cap ...)".
    model = slimact.convert(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2, inplace=True), nn.Linear(16, 4)), "int8")
    s = slimact.summary(model, torch.randn(4, 16))
    assert "1" not in s.modules and "in place (inplace=True)" in s.skipped["1"], s.skipped
    assert not any("soft cap" in note for note in s.notes), s.notes


def test_tempo_policy_converts_only_lossless_kinds():
    model = slimact.convert(_model(), "tempo")
    kinds = {m._slimact_kind for m in model.modules() if isinstance(m, SlimModule)}
    assert kinds == {"dropout", "layernorm", "gelu"}
    assert "lossless" in slimact.summary(model).skipped["3"]


class MyLinear(nn.Linear):
    pass


def test_subclass_of_linear_keeps_its_class_in_mro():
    model = slimact.convert(nn.Sequential(MyLinear(4, 4)))
    assert isinstance(model[0], MyLinear) and isinstance(model[0], SlimModule)
    slimact.revert(model)
    assert type(model[0]) is MyLinear


def test_hf_gpt2_conv1d_is_converted():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 32))
    model.train()
    torch.manual_seed(1)  # the same dropout masks in both runs
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    g0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    slimact.convert(model, slimact.Policy(kinds=("linear",)))  # Conv1D alone: the forward stays bit-exact
    conv = model.transformer.h[0].attn.c_attn
    assert isinstance(conv, transformers.pytorch_utils.Conv1D) and isinstance(conv, SlimModule)
    assert slimact.summary(model).converted["linear"] == 2 * 4 + 1
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, ref.logits)
    out.loss.backward()
    for n, p in model.named_parameters():
        assert cosine(g0[n], p.grad) >= 0.99, n


def _train_steps(model, ids, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(ids).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("policy", ["int8", "mesa", "tempo"])
def test_whole_model_survives_save_load_and_deepcopy(tmp_path, policy):
    import io

    model = slimact.convert(_model(), policy)
    _train_steps(model, IDS)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [torch.load(buf, weights_only=False), copy.deepcopy(model)]  # both taken at the same step
    torch.manual_seed(3)  # the same generator state, hence the same stochastic rounding ("mesa")
    out0, g0 = _step(model, IDS)
    for other in copies:
        assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()]
        torch.manual_seed(3)
        out1, g1 = _step(other, IDS)
        assert torch.equal(out0, out1)
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_a_converted_submodule_outliving_its_model_can_be_copied(policy):
    """A converted block put in another model, its first model dropped: torch's hook handles of the dropped model,
    which the routing on the block kept, could not be deep-copied ("cannot create weak reference to 'NoneType'
    object"), so neither could the new model. Its copy computes as the block does."""
    import gc

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    slimact.convert(nn.Sequential(block, nn.Linear(8, 4)), policy)
    gc.collect()
    other = nn.Sequential(block, nn.Linear(8, 2))
    twin = copy.deepcopy(other)
    x = torch.randn(4, 8)
    out0, g0 = _step(other, x)
    out1, g1 = _step(twin, x)
    assert torch.equal(out0, out1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


class _Hooked(nn.LayerNorm):
    """A LayerNorm of the model's own class (converted to a class slimact makes at run time) holding a method bound to
    itself, as transformers' ``GELUActivation("gelu_python")`` does (``self.act = self._gelu_python``: SEW-D's)."""

    def __init__(self, width):
        super().__init__(width)
        self.calls = 0
        self.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


@pytest.mark.parametrize("policy", ["int8", "mesa", "tempo"])
def test_a_converted_module_whose_state_refers_to_itself_survives_deepcopy_and_save(policy):
    """A converted module of a class slimact makes at run time was deep-copied and pickled with its state as an
    argument of its rebuild: a state referring back to the module (a method bound to it) recursed without end
    (RecursionError: deepcopy of any converted SEW-D, hence also ``slimact.check`` under "mesa")."""
    import io

    from slimact.nn._base import _rebuild

    model = nn.Sequential(nn.Linear(8, 16), _Hooked(16), nn.Linear(16, 8))
    slimact.convert(model, policy)
    cls = type(model[1])
    assert isinstance(model[1], SlimModule) and getattr(sys.modules[cls.__module__], cls.__qualname__, None) is not cls
    x = torch.randn(4, 8)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), torch.load(buf, weights_only=False)]
    for other in copies:
        (hook,) = (h for h in other[1]._forward_pre_hooks.values() if getattr(h, "__name__", None) == "_count")
        assert hook.__self__ is other[1]  # the copy's hook is bound to the copy
    torch.manual_seed(0)
    out0, g0 = _step(model, x)
    for other in copies:
        torch.manual_seed(0)
        out1, g1 = _step(other, x)
        assert torch.equal(out0, out1)
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n
    old = model[1].__reduce_ex__(2)  # as slimact pickled a module before: its state an argument of _rebuild
    rebuilt = _rebuild(*old[1], copy.deepcopy(old[2]))
    assert type(rebuilt) is cls
    h = torch.randn(4, 16, requires_grad=True)
    torch.testing.assert_close(rebuilt(h), model[1](h), rtol=0, atol=0)


@pytest.mark.slow
def test_converted_hf_model_loads_in_a_fresh_process(tmp_path):
    pytest.importorskip("transformers")
    import subprocess
    import sys

    from _harness import tiny_hf

    model, inputs = tiny_hf("gpt2")
    slimact.convert(model, "int8")
    torch.save({"model": model, "inputs": inputs}, tmp_path / "m.pt")
    code = (
        "import torch, slimact\n"
        f"d = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
        "m = d['model']\n"
        "assert m.config._attn_implementation == 'slimact'\n"
        "m(**d['inputs']).loss.backward()\n"
        "assert slimact.summary(m).converted['attention'] == 2\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_dtype_moves_and_trained_weights_survive_revert():
    model = slimact.convert(_model(), "mesa")
    _train_steps(model, IDS)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    model.half()
    assert all(p.dtype == torch.float16 for p in model.parameters())
    model.to(torch.float32)
    _train_steps(model, IDS, steps=1)  # still trains after the moves (running estimates follow the dtype)
    model.load_state_dict(trained, strict=True)
    slimact.revert(model)
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())


def test_deterministic_runs_give_bit_identical_gradients():
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            torch.manual_seed(0)
            model = slimact.convert(_model(), "mesa")  # stochastic rounding and running estimates
            torch.manual_seed(1)
            grads.append(_step(model, IDS)[1])
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("between", ["no_grad", "inference_mode", "eval"])
def test_a_pass_that_packs_nothing_between_steps_leaves_later_steps_bit_for_bit(between):
    # A no-grad forward in train mode (generate() with dropout on, an RL reference's log-probabilities) counted as a
    # step: every later step's stochastic-rounding seeds moved (a sweep; an eval pass had been mended before).
    grads = []
    for extra in (False, True):
        torch.manual_seed(0)
        model = slimact.convert(_model(), "mesa")
        torch.manual_seed(1)
        _step(model, IDS)
        if extra:
            context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                       "eval": contextlib.nullcontext}[between]()
            model.train(between != "eval")
            with context:
                model(IDS)
            model.train()
        torch.manual_seed(2)
        grads.append(_step(model, IDS)[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_a_pass_begun_without_gradients_that_packs_is_a_step():
    # A model called under no_grad whose forward turns gradients on again packs: counted, or every such step drew the
    # same stochastic-rounding seeds (a review of the fix above).
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()

        def forward(self, ids):
            with torch.enable_grad():
                return self.body(ids)

    model = slimact.convert(Inner(), "mesa")
    counter = model.__dict__["_slimact_root_hook"][1]
    for step in range(1, 4):
        with torch.no_grad():
            out = model(IDS)
        out.float().pow(2).mean().backward()
        assert counter.value == step


def test_summary_coverage_of_a_model_that_is_itself_a_converted_module_is_whole():
    # The summary names the root "", profile "(model)": a converted nn.Linear as the whole model had 73% coverage,
    # "not covered: (model)" for slimact's own codes (found by a helper's review).
    x = torch.randn(2, 16, 32)
    model = slimact.convert(nn.Linear(32, 64), "int8")
    summary = slimact.summary(model, x)
    assert summary.converted == {"linear": 1} and summary.coverage == 1.0 and not summary.uncovered


def test_summary_coverage_flags_attention_that_never_reached_slimact():
    import copy as _copy

    from slimact import zoo

    model = zoo.build("llama", tiny=True).train()
    inputs = zoo.example_inputs(model, 2, 16)
    slimact.convert(model)
    full = slimact.summary(model, inputs)
    assert full.converted["attention"] == 2 and full.coverage >= 0.95
    # A module reading a configuration slimact did not switch computes attention its own way.
    stray = model.model.layers[0].self_attn
    stray.config = _copy.deepcopy(stray.config)
    stray.config._attn_implementation = "sdpa"
    report = slimact.summary(model, inputs)
    assert report.converted["attention"] == 1
    assert "none of its attention ran through" in report.skipped["model.layers.0.self_attn"]
    assert report.coverage < full.coverage
    assert "model.layers.0.self_attn" in report.uncovered


def test_two_models_sharing_one_config_restore_it_when_the_last_reverts():
    """Item 5 of issue 18: the second convert recorded "slimact" (set by the first) as the original."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    a, b = transformers.GPT2LMHeadModel(cfg), transformers.GPT2LMHeadModel(cfg)
    original = cfg._attn_implementation
    slimact.convert(a)
    slimact.convert(b)
    assert cfg._attn_implementation == "slimact"
    slimact.revert(a)
    assert cfg._attn_implementation == "slimact", "b is still converted"
    ids = torch.randint(0, 96, (2, 16))
    reverted = copy.deepcopy(a).train()
    plain = transformers.GPT2LMHeadModel(copy.deepcopy(cfg)).train()
    plain.config._attn_implementation = original
    plain.load_state_dict(reverted.state_dict())
    torch.manual_seed(0)
    out0 = plain(input_ids=ids, labels=ids).loss
    torch.manual_seed(0)
    out1 = reverted(input_ids=ids, labels=ids).loss  # a, reverted, runs SDPA as the plain model does
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    slimact.revert(b)
    assert cfg._attn_implementation == original
    slimact.convert(a)
    slimact.convert(a, "tempo")  # re-converting one model does not count it twice
    slimact.revert(a)
    assert cfg._attn_implementation == original



def test_t5s_encoder_and_decoder_config_copies_are_all_switched_and_restored():
    """docs/models.md (T5): T5 gives its encoder and decoder copies of the config; every config an attention module
    reads is switched to slimact's attention, and revert restores each."""
    pytest.importorskip("transformers")
    from slimact import zoo

    model = zoo.build("t5", tiny=True)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    assert len(configs) >= 3  # the model's, the encoder's and the decoder's
    before = {k: c._attn_implementation for k, c in configs.items()}
    slimact.convert(model)
    assert {c._attn_implementation for c in configs.values()} == {"slimact"}
    slimact.revert(model)
    assert {k: c._attn_implementation for k, c in configs.items()} == before

def test_parametrisation_added_after_convert_survives_revert():
    """Item 6 of issue 18: weight_norm on a converted Linear, then revert, lost the parametrised class."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    slimact.convert(model, "int8")
    torch.nn.utils.parametrizations.weight_norm(model[0])
    x = torch.randn(3, 8)
    slimact.revert(model)
    assert not any(isinstance(m, SlimModule) for m in model.modules())
    assert torch.nn.utils.parametrize.is_parametrized(model[0], "weight")
    plain = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    torch.nn.utils.parametrizations.weight_norm(plain[0])
    plain.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    torch.nn.utils.parametrize.remove_parametrizations(model[0], "weight")
    assert type(model[0]) is nn.Linear


class _CodeBlock(nn.Module):
    """A block whose activation and dropout are calls in its own code (routed by the conversion it belongs to)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(nn.functional.dropout(nn.functional.gelu(self.fc1(x)), 0.1, self.training))


@pytest.mark.parametrize("then", ["convert the model tempo", "revert the model"])
def test_a_submodule_converted_on_its_own_follows_the_whole_model_afterwards(then):
    # convert(model[1], "int8") installs its own routing of the calls in its code; neither a later convert of the
    # whole model ("tempo": gradients equal to plain's) nor revert(model) removed it, so those calls stayed 8-bit.
    from _harness import assert_gradients_equal

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(50, 32), _CodeBlock(), nn.Linear(32, 50)).train()
    model = copy.deepcopy(plain)
    slimact.convert(model[1], "int8")
    if then == "revert the model":
        slimact.revert(model)
        assert not model[1]._forward_pre_hooks and not any("slimact" in k for k in model[1].__dict__)
    else:
        slimact.convert(model, "tempo")
    torch.manual_seed(1)
    want = _step(plain, IDS)
    torch.manual_seed(1)
    got = _step(model, IDS)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    if then == "revert the model":
        for n in want[1]:
            torch.testing.assert_close(got[1][n], want[1][n], rtol=0, atol=0, msg=n)
    else:
        assert_gradients_equal(want[1], got[1])


def test_a_block_reverted_in_a_model_converted_as_a_whole_keeps_what_plain_keeps():
    # revert(model.transformer.h[0]) after convert(model) gave the block back its classes, but the model's routing
    # still compressed the calls in its code (F.layer_norm, F.dropout, attention): 8-bit tensors where the reverted
    # block was to be plain (found by a helper's review). Its calls now run as written; the other blocks stay converted,
    # and a later convert of the model converts it again.
    from slimact import zoo

    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, 2, 16)
    plain = slimact.profile(copy.deepcopy(model), inputs)
    slimact.convert(model, "int8")
    slimact.revert(model.transformer.h[0])

    def block(report, prefix):
        return sorted((e.module, str(e.dtype), e.shape, e.nbytes) for e in report.entries
                      if e.module.startswith(prefix))

    report = slimact.profile(model, inputs)
    assert block(report, "transformer.h.0.") == block(plain, "transformer.h.0.")
    assert {e.dtype for e in report.entries if e.module.startswith("transformer.h.1.")} >= {torch.uint8}
    slimact.convert(model, "int8")
    assert {e.dtype for e in slimact.profile(model, inputs).entries if e.module.startswith("transformer.h.0.")} >= {
        torch.uint8}


def test_a_convert_that_raises_midway_leaves_the_model_plain():
    # A filter_fn raising on the fourth module left the modules before it converted, compressing, with no routing,
    # no attention setting, and summary saying "not converted" (found by a helper's review).
    from slimact import zoo

    model = zoo.build("gpt2", tiny=True)
    inputs = zoo.example_inputs(model, 2, 16)
    plain = slimact.profile(copy.deepcopy(model), inputs)
    seen = []

    def fails(module, name):
        seen.append(name)
        if len(seen) == 4:
            raise KeyError("the user's filter")
        return True

    for converted_before in (False, True):
        if converted_before:
            slimact.convert(model, "int8")
        seen.clear()
        with pytest.raises(KeyError, match="the user's filter"):
            slimact.convert(model, "int8", filter_fn=fails)
        assert not any(isinstance(m, SlimModule) for m in model.modules())
        report = slimact.profile(model, inputs)
        assert report.activation_bytes == plain.activation_bytes
        assert torch.uint8 not in {e.dtype for e in report.entries}


def test_a_filter_is_asked_of_each_module_as_the_plain_model_has_it_on_a_second_convert():
    # On a second convert, filter_fn was handed slimact's classes: a filter on the class (type(m) is nn.LayerNorm)
    # let every converted LayerNorm through, and they stayed converted (found by a helper's review).
    from slimact import zoo

    def no_layer_norm(module, name):
        return type(module) is not nn.LayerNorm

    model = zoo.build("gpt2", tiny=True)
    slimact.convert(model, "int8")
    assert slimact.summary(model).converted["layernorm"] > 0
    slimact.convert(model, "int8", filter_fn=no_layer_norm)
    assert "layernorm" not in slimact.summary(model).converted
    assert not any(isinstance(m, nn.LayerNorm) and isinstance(m, SlimModule) for m in model.modules())
    assert slimact.summary(model).converted["linear"] > 0


class _ByKeyword(nn.Module):
    """Every converted kind called with its input by keyword, by the name its own forward gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8)
        self.norm, self.fc, self.act = nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU()
        self.drop, self.soft, self.rms, self.out = nn.Dropout(0.2), nn.Softmax(-1), nn.RMSNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.bn(input=self.conv(input=x.transpose(1, 2))).transpose(1, 2)
        h = self.drop(input=self.act(input=self.fc(input=self.norm(input=h))))
        return self.out(input=self.rms(x=h) * self.soft(input=h))


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_layers_called_with_their_input_by_keyword_run_as_plain(policy):
    # slimact's forwards named their input `x`: `linear(input=x)`, a keyword nn.Linear's forward accepts, raised
    # TypeError ("unexpected keyword argument 'input'", or "missing 'x'" for norms and activations) after convert.
    from _harness import assert_gradients_close, assert_gradients_equal

    torch.manual_seed(0)
    plain = _ByKeyword().train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert {"norm", "act", "drop", "rms"} <= set(slimact.summary(slim).modules)
    x = torch.randn(3, 5, 8)
    steps = []
    for model in (plain, slim):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout draws
        out = model(x)
        (out * torch.linspace(-1.0, 2.0, out.numel()).view(out.shape)).sum().backward()
        steps.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (out0, g0), (out1, g1) = steps
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(g0, g1)


@pytest.mark.parametrize("flash", [True, False])
def test_summary_with_inputs_drops_a_watched_attention_whose_products_never_reached_slimact(flash):
    # With the policy's attention kind off, nanoGPT's attention (F.scaled_dot_product_attention, or by hand) is
    # watched for its products and softmaxes, and summary reported it converted: right by hand (they are routed),
    # wrong with flash, whose SDPA runs as written (its q, k, v kept fp32, nothing 8-bit), inputs given or not.
    policy = slimact.Policy(kinds=tuple(k for k in KINDS if k != "attention"))
    slim = slimact.convert(_nano.NanoGPT(flash=flash).train(), policy)
    summary = slimact.summary(slim, _nano.batch(), loss_fn=_nano.loss_of)
    dtypes = {e.dtype for e in slimact.profile(slim, _nano.batch(), loss_fn=_nano.loss_of).entries
              if e.module == "transformer.h.0.attn"}
    assert (torch.uint8 in dtypes) == (not flash), dtypes
    if flash:
        assert "transformer.h.0.attn" not in summary.modules
        assert "none reached slimact" in summary.skipped["transformer.h.0.attn"]
    else:
        assert summary.modules["transformer.h.0.attn"] == "attention"


def test_exclude_index_leaves_alone_the_attention_and_the_loss_it_names():
    # Hugging Face attention modules are routed through slimact's attention function, not replaced, and the LM loss
    # is routed, not a module: "attention:1" and "lmloss:0" were checked by Policy but never reached these, so both
    # stayed converted, silently.
    pytest.importorskip("transformers")
    from _harness import tiny_hf

    model, inputs = tiny_hf("gpt2")
    slimact.convert(model, slimact.Policy(exclude_index=("attention:1", "lmloss:0")))
    s = slimact.summary(model)
    assert s.modules.get("transformer.h.0.attn") == "attention"
    assert "transformer.h.1.attn" not in s.modules
    assert s.skipped["transformer.h.1.attn"] == "excluded by index (attention:1)"
    assert "(loss)" not in s.modules and s.skipped["(loss)"] == "excluded by index (lmloss:0)"
    assert slimact.attention.POLICY_ATTR not in model.transformer.h[1].attn.__dict__
    model(**inputs).loss.backward()  # the excluded attention runs as written, under the same config


def test_attention_excluded_by_index_computes_as_written():
    # An attention module excluded by index was left untagged, but the F.scaled_dot_product_attention in its code
    # (transformers' sdpa function) was still routed through slimact's attention (an exclude pattern stops that):
    # with both of tiny GPT-2's attentions excluded and nothing else converted, the loss and 28 gradients differed
    # from plain's.
    pytest.importorskip("transformers")
    from _harness import loss_grads, tiny_hf

    plain, inputs = tiny_hf("gpt2")
    slim = slimact.convert(copy.deepcopy(plain), slimact.Policy(kinds=("attention",),
                                                                exclude_index=("attention:0", "attention:1")))
    assert slimact.summary(slim).converted == {}
    loss0, g0 = loss_grads(plain, inputs)
    loss1, g1 = loss_grads(slim, inputs)
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(g1[n], g) for n, g in g0.items())


def test_an_exclude_index_naming_no_module_of_the_model_is_warned_of():
    # A Mesa policy file names layers by index; one written for another model silently excluded nothing.
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"exclude_index \['linear:2'\] name no module .*'linear': 2"):
        slimact.convert(copy.deepcopy(model), slimact.Policy(exclude_index=("linear:2", "linear:1")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = slimact.convert(copy.deepcopy(model), slimact.Policy(exclude_index=("linear:1",)))
    assert list(slimact.summary(converted).skipped) == ["2"]


def test_an_include_or_exclude_pattern_matching_no_module_is_warned_of():
    # A typo in a pattern ("0" for "1", "h.00") protected nothing (exclude) or converted nothing (include), silently.
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"exclude pattern\(s\) \['3'\] match no module .*left alone"):
        slimact.convert(copy.deepcopy(model), slimact.Policy(exclude=("3", "2")))
    with pytest.warns(UserWarning, match=r"include pattern\(s\) \['linear\*'\] match no module .*converted"):
        slimact.convert(copy.deepcopy(model), slimact.Policy(include=("linear*", "0")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the routing's own names: "(loss)", "(functional)")
        converted = slimact.convert(copy.deepcopy(model), slimact.Policy(exclude=("2", "(loss)", "(functional)")))
        assert list(slimact.summary(converted).skipped) == ["2"]
        # A warning turned into an error is raised before anything changes: the model stays as it was converted.
        with pytest.raises(UserWarning, match="match no module"):
            slimact.convert(converted, slimact.Policy(exclude=("3",)))
    assert list(slimact.summary(converted).skipped) == ["2"] and isinstance(converted[0], SlimModule)


def test_a_pattern_naming_a_block_covers_every_module_inside_it():
    # exclude=("transformer.h.0",) left alone the block's own code but converted its norms, projections, GELU and
    # attention: with the whole model excluded, tiny GPT-2's gradients were 8-bit approximations.
    # include=("transformer.h.0",) converted nothing at all.
    pytest.importorskip("transformers")
    from _harness import loss_grads, tiny_hf

    plain, inputs = tiny_hf("gpt2")
    names = [n for n, _ in plain.named_modules()]
    slim = slimact.convert(copy.deepcopy(plain), slimact.Policy(exclude=("transformer", "lm_head", "(loss)")))
    assert slimact.summary(slim).converted == {}
    assert slimact.summary(slim).skipped["transformer.h.0.mlp.c_fc"] == "matched by policy exclude patterns"
    loss0, g0 = loss_grads(plain, inputs)
    loss1, g1 = loss_grads(slim, inputs)
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(g1[n], g) for n, g in g0.items())

    block = slimact.convert(copy.deepcopy(plain), slimact.Policy(include=("transformer.h.0",)))
    converted = slimact.summary(block).modules
    assert set(converted) == {n for n in names if n.startswith("transformer.h.0.")} - {
        "transformer.h.0.attn", "transformer.h.0.mlp"} | {"transformer.h.0.attn"}
    assert converted["transformer.h.0.mlp.c_fc"] == "linear"
    assert converted["transformer.h.0.attn"] == "attention"


def test_a_head_excluded_by_name_leaves_the_loss_as_written():
    # The routed LM loss computes the head's product itself: exclude=("lm_head",) left the Linear alone and still
    # computed the head in the loss's chunks (no logits tensor, no hook of the head's run).
    pytest.importorskip("transformers")
    from _harness import loss_grads, tiny_hf

    plain, inputs = tiny_hf("gpt2")
    by_name = slimact.convert(copy.deepcopy(plain), slimact.Policy(exclude=("lm_head",)))
    assert "(loss)" not in slimact.summary(by_name).modules
    assert slimact.summary(by_name).skipped["(loss)"].startswith("its head lm_head is excluded")
    both = slimact.convert(copy.deepcopy(plain), slimact.Policy(exclude=("lm_head", "(loss)")))
    by_filter = slimact.convert(copy.deepcopy(plain), "int8", filter_fn=lambda m, name: name != "lm_head")
    loss0, g0 = loss_grads(both, inputs)
    for model in (by_name, by_filter):
        loss1, g1 = loss_grads(model, inputs)
        assert torch.equal(loss1, loss0)
        assert all(torch.equal(g1[n], g) for n, g in g0.items())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_converting_under_no_grad_or_inference_mode_converts_as_outside(mode):
    # Each activation's probe for an in-place write read its probe tensor's version counter: under inference_mode,
    # which gives no tensor one, convert raised ("Inference tensors do not track version counter"); before that
    # probe, a gated MLP was left unfused there (its probe could not ask for gradients).
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "nn"))
    from test_mlp import HFMLP

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.LayerNorm(16), HFMLP(), nn.GELU(), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 4))

    outside, inside = slimact.summary(slimact.convert(model(), "int8")), model()
    with getattr(torch, mode)():
        slimact.convert(inside, "int8")
    inside = slimact.summary(inside)
    assert inside.modules == outside.modules and inside.skipped == outside.skipped
    assert outside.modules["1"] == "mlp"


class _AttentionBlock(nn.Module):
    def __init__(self, cap: float | None) -> None:
        super().__init__()
        self.attn, self.norm = HandWrittenAttention(32, cap=cap), nn.LayerNorm(32)

    def forward(self, x):
        return x + self.attn(self.norm(x))


def test_summary_coverage_counts_what_ops_left_as_written_keep_inside_a_converted_module():
    # A reporting audit: attention in model code with a tanh soft cap (or a learned temperature) on its scores was
    # converted, coverage 100%, while the tanh kept its fp32 [B, H, T, S] input, 65% of the module's bytes. What ops
    # left as written keep inside a converted module is not covered now, and summary says where.
    x = torch.randn(2, 32, 32)
    for cap in (None, 30.0):
        torch.manual_seed(0)
        model = slimact.convert(_AttentionBlock(cap), "int8")
        summary = slimact.summary(model, x)
        assert "attn" in summary.modules
        report = slimact.profile(model, x)
        scores = 2 * 4 * 32 * 32 * 4  # fp32 [B, H, T, S]
        if cap is None:
            assert report.as_written.get("attn", 0) < scores // 4 and summary.coverage > 0.95, summary
        else:
            assert report.as_written["attn"] >= scores and summary.uncovered["attn"] >= scores
            assert summary.coverage < 0.9, summary
            note = next(n for n in summary.notes if "leaves as written in their code" in n)
            assert "attn (0.03 MiB)" in note, note
    # (slimact's own codes are never counted there: every 8-bit tensor kept is slimact's)
    assert not [e for e in report.entries if not e.slimact and e.dtype == torch.uint8]


def test_the_note_on_what_ops_left_as_written_keep_names_converted_modules_only():
    # A review: under "tempo" GPT-2's c_proj Linears (a kind tempo leaves alone) sit under converted attention; the
    # note called them converted modules keeping tensors through model code. They count as not covered, as any
    # module left alone does, and the note names none of them.
    from slimact import zoo

    model = zoo.build("gpt2", tiny=True).train()
    inputs = zoo.example_inputs(model, 2, 16)
    summary = slimact.summary(slimact.convert(model, "tempo"), inputs)
    assert "transformer.h.0.attn.c_proj" in summary.uncovered and "transformer.h.0.attn.c_proj" in summary.skipped
    assert not [n for n in summary.notes if "leaves as written in their code" in n], summary.notes


def test_summary_with_inputs_copies_a_pruned_model():
    # summary(model, inputs) profiles a plain copy; PyTorch's deepcopy refused the non-leaf weight pruning recomputes
    # before each call (after a forward it is one).
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    slimact.convert(model, "int8")
    x = torch.randn(4, 10, 16)
    model(x).sum().backward()
    report = slimact.summary(model, x)
    assert report.converted == {"gelu": 1, "layernorm": 1, "linear": 2}
    assert report.coverage is not None and report.coverage > 0.9


def test_a_tentative_pass_and_a_pass_it_makes_draw_apart(monkeypatch):
    # A pass begun without gradients that turns them on and calls the model again: both streams were keyed with the
    # next step, and their first packs drew the same stochastic-rounding seed (a review).
    import slimact.nn._base as base

    class CallsItself(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.depth = nn.Linear(16, 16), 0

        def forward(self, x):
            with torch.enable_grad():
                h = self.a(x)
                if self.depth == 0:
                    self.depth = 1
                    h = h + self(x)
                    self.depth = 0
            return h

    model, keys = slimact.convert(CallsItself(), "mesa"), []
    begin = base.begin_stream
    monkeypatch.setattr(base, "begin_stream", lambda step: keys.append(step) or begin(step))
    with torch.no_grad():
        out = model(torch.randn(8, 16, requires_grad=True))
    out.sum().backward()
    assert len(keys) == 2 and keys[0] != keys[1], keys
    assert model.__dict__["_slimact_root_hook"][1].value == 2  # (the inner pass, and the outer, which packed)


def test_summary_says_a_reverted_block_was_reverted():
    # A block reverted after convert was listed as "excluded (filter_fn or an exclude pattern)", its modules as "came
    # into the model after convert" (a sweep's review of summary's wording).
    model = slimact.convert(_model(), "int8")
    slimact.revert(model[1])
    skipped = slimact.summary(model).skipped
    assert skipped["1"].startswith("reverted after convert")
    assert all(why == "inside 1, reverted after convert: plain" for name, why in skipped.items()
               if name.startswith("1.")), skipped
    assert "2" not in skipped


class _Attend(nn.Module):
    """lucidrains' attention core as its own module (no attention in its class name): einsums and a softmax."""

    def forward(self, q, k, v):
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        return torch.einsum("bhij,bhjd->bhid", sim.softmax(-1), v)


class _InnerAttention(nn.Module):
    def __init__(self, d: int = 32, attend: bool = False, float64: bool = False) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.attend = _Attend() if attend else None
        self.float64 = float64

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        if self.float64:  # scores in float64 "for stability": nothing of it is slimact's
            q, k, v = q.double(), k.double(), v.double()
        if self.attend is not None:
            o = self.attend(q, k, v)
        else:
            o = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v
        return self.out(o.float().transpose(1, 2).reshape(b, n, d))


class _OuterAttention(nn.Module):
    """An attention module whose attention is a child's (colt5-attention's ConditionalRoutedAttention > Attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.inner = nn.LayerNorm(32), _InnerAttention()

    def forward(self, x):
        return self.inner(self.norm(x)) + x


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_summary_with_inputs_of_an_attention_inside_an_attention(policy):
    # summary(model, inputs) raised KeyError under "tempo": the inner module, dropped as the outer's attention,
    # was dropped again as idle (colt5, routing-transformer, local-attention, block-recurrent; a sweep 2026-12-07).
    torch.manual_seed(0)
    model = slimact.convert(nn.Sequential(_OuterAttention()), policy)
    summary = slimact.summary(model, torch.randn(2, 16, 32))
    assert [name for name, kind in summary.modules.items() if kind == "attention"] == (
        [] if policy == "tempo" else ["0"]), summary.modules
    assert "0.inner" not in summary.modules and "0.inner" not in summary.skipped, summary


def test_summary_reasons_follow_where_attention_calls_were_routed():
    # An attention core module inside an attention (lucidrains' Attend) is routed as that attention's: it was said
    # to be "left as written" beside a coverage of 100%. An attention computing in float64 routes nothing: it was
    # reported converted, the call marked routed before the handler ran it as written.
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    attend = slimact.convert(nn.Sequential(nn.LayerNorm(32), _InnerAttention(attend=True)), "int8")
    summary = slimact.summary(attend, x)
    assert summary.modules["1"] == "attention" and "1.attend" not in summary.skipped, summary
    assert summary.coverage == pytest.approx(1.0), summary
    in_float64 = slimact.convert(nn.Sequential(_InnerAttention(float64=True), nn.Linear(32, 8)), "int8")
    summary = slimact.summary(in_float64, x)
    assert "0" not in summary.modules and "in float64" in summary.skipped["0"], summary


class _ConfigCopied(nn.Linear):
    """A layer whose deep copy rebuilds it from its config (``self.__class__(...)``), as PyTorch Geometric's did."""

    def __deepcopy__(self, memo):
        new = self.__class__(self.in_features, self.out_features, bias=self.bias is not None)
        new.load_state_dict(self.state_dict())
        return new


def test_an_instance_made_by_calling_a_converted_modules_class_runs_as_its_own_class():
    # type(layer)(...) (a config clone, a __deepcopy__ rebuilding itself) made an instance of slimact's class with none
    # of slimact's attributes: its training forward raised AttributeError ('_slimact_policy'), and revert and check
    # of a deep copy raised too ('_slimact_orig_cls'), where plain PyTorch runs.
    torch.manual_seed(0)
    model = slimact.convert(nn.Sequential(_ConfigCopied(8, 16), nn.GELU(), _ConfigCopied(16, 4)).train(), "int8")
    x = torch.randn(2, 8)
    clone = type(model[0])(8, 16).train()
    clone.load_state_dict(model[0].state_dict())
    torch.testing.assert_close(clone(x), nn.functional.linear(x, clone.weight, clone.bias), rtol=0, atol=0)
    twin = copy.deepcopy(model)
    twin(x.requires_grad_()).sum().backward()
    # (the clone itself deep-copies, pickles and converts: each read the attribute only convert sets)
    copy.deepcopy(clone)
    slimact.convert(nn.Sequential(clone), "int8")(x).sum().backward()
    plain = slimact.revert(copy.deepcopy(model))
    assert type(plain[0]) is _ConfigCopied and not isinstance(plain[0], SlimModule)
    assert slimact.check(model, x).passed
