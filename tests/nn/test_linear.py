import copy
import math

import pytest
import torch
from torch import nn

import slimact
from _harness import LinearOnlyWeight, assert_gradients_close, assert_gradients_equal, estimates
from slimact._metrics import sqnr_db


def test_is_an_nn_linear_with_identical_output_and_close_grads():
    torch.manual_seed(0)
    ref = nn.Linear(40, 24)
    lin = slimact.nn.Linear(40, 24)
    lin.load_state_dict(ref.state_dict(), strict=True)
    assert isinstance(lin, nn.Linear)
    x = torch.randn(3, 7, 40, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y_ref = lin(x), ref(x2)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
    assert sqnr_db(ref.weight.grad, lin.weight.grad) >= 30


def test_eval_mode_is_the_plain_forward(monkeypatch):
    import importlib

    monkeypatch.setattr(
        importlib.import_module("slimact.functional.linear"), "pack", lambda *a, **k: pytest.fail("packed in eval")
    )
    lin = slimact.nn.Linear(8, 4).eval()
    x = torch.randn(2, 8, requires_grad=True)
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))


def test_running_policy_state_is_non_persistent():
    lin = slimact.nn.Linear(8, 4, policy="mesa")
    keys = set(lin.state_dict())
    lin(torch.randn(32, 8, requires_grad=True)).sum().backward()  # (not few rows: a running estimate)
    assert estimates(lin)["_slimact_x_lo"] is not None
    assert set(lin.state_dict()) == keys == {"weight", "bias"}
    assert "slimact" in repr(lin)


@pytest.mark.parametrize("form", [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU()], ids=["gelu", "tanh", "silu"])
def test_activation_and_next_linear_keep_one_copy(form):
    # The MLP's [tokens, 4 x hidden] tensor: the activation keeps its input at 8 bits and the next Linear
    # rebuilds the activation's output from the same codes, instead of keeping a second 8-bit copy.
    from _harness import check_against_plain

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 128), form, nn.Linear(128, 32))
    x = torch.randn(4, 16, 32, requires_grad=True)
    check_against_plain(mlp, x)  # forward identical, every gradient >= 30 dB
    by_module = slimact.profile(slimact.convert(mlp), x).by_module
    assert by_module.get("2", 0) == 0 and by_module["1"] > 0


def test_an_activation_input_beyond_the_clamp_is_not_shared():
    # The 8-bit activation input is clamped to where its derivative is flat (|x| <= 6 for GELU): then the
    # codes cannot rebuild y = gelu(x) beyond it, and the next Linear keeps y itself.
    from _harness import check_against_plain

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    with torch.no_grad():
        mlp[0].bias[:4] = 20.0  # some pre-activations far beyond the clamp
    x = torch.randn(4, 16, 32, requires_grad=True)
    check_against_plain(mlp, x)
    assert slimact.profile(slimact.convert(mlp), x).by_module["2"] > 0


def test_a_call_sets_no_attribute_through_module_setattr(monkeypatch):
    # nn.Module.__setattr__ searches the module's parameters, buffers and submodules on every write: a converted
    # module's per-call bookkeeping (its call site) writes its plain attributes into __dict__ instead. The call
    # sites still count up within a forward pass and restart with the next.
    model = slimact.convert(nn.Sequential(nn.Linear(8, 8)), "int8").train()
    linear = model[0]
    writes = []
    original = nn.Module.__setattr__
    monkeypatch.setattr(nn.Module, "__setattr__", lambda self, name, value: writes.append(name) or original(
        self, name, value))
    x = torch.randn(2, 8, requires_grad=True)
    model(x).sum().backward()
    assert not [w for w in writes if w.startswith("_slimact_")], writes
    sites = []
    for _ in range(2):
        linear._slimact_steps(model, ())  # the model's step counter, as its hooks call it
        for _ in range(3):
            linear._slimact_begin()
            sites.append(linear._slimact_site)
        linear._slimact_steps.end(model, (), None)
    assert sites == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("order", ["quantised then converted", "converted then quantised"])
@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_a_quantised_frozen_weight_runs_pytorchs_linear_so_the_base_trains(policy, order):
    # A weight of a tensor subclass (torchao's quantised weights) runs F.linear, as its class implements it:
    # slimact's Function's backward, grad_y @ W, called an op such weights do not implement: LoRA over an int8
    # weight-only base (torchao's quantize_, then PEFT) raised NotImplementedError ("Int8Tensor dispatch: ... aten.mm")
    # where PyTorch trained. Quantised before convert, the Linear is left alone with the reason (it had been counted
    # converted); quantised after, the converted Linear runs F.linear.
    def quantise(model):
        for i in (0, 2):  # (as quantize_ leaves them: a frozen parameter of the weight's class)
            model[i].weight = nn.Parameter(LinearOnlyWeight.of(model[i].weight), requires_grad=False)
        return model

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))

    plain = quantise(build())
    if order == "quantised then converted":
        slim = slimact.convert(quantise(build()), policy)
        assert not isinstance(slim[0], slimact.nn.SlimModule)
        if policy == "int8":  # ("tempo" has no Linear saving: that is its reason)
            assert "its weight is a tensor subclass, LinearOnlyWeight" in slimact.summary(slim).skipped["0"]
    else:
        slim = quantise(slimact.convert(build(), policy))
        assert isinstance(slim[0], slimact.nn.SlimModule) == (policy == "int8")
    x = torch.randn(4, 8, 32)
    grads = []
    for model in (plain, slim):
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        (out * torch.linspace(-1, 1, 32)).sum().backward()
        grads.append((out.detach(), {"input": xi.grad, **{n: p.grad for n, p in model.named_parameters()
                                                         if p.grad is not None}}))
    (out0, g0), (out1, g1) = grads
    assert torch.equal(out0, out1)
    assert g0.keys() == g1.keys() == {"input", "0.bias", "2.bias", "3.weight", "3.bias"}
    # (the Linears compute as PyTorch's; the GELU and LayerNorm are slimact's, lossless or 8-bit)
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(g0, g1)


def test_a_frozen_fp32_weight_under_autocast_keeps_no_low_precision_copy():
    # Under bf16 autocast, F.linear keeps autocast's bf16 cast of a frozen fp32 weight (autocast caches casts of
    # leaves that need a gradient only); slimact's Function keeps the weight itself and casts it in the backward. A
    # frozen Linear whose input needs a gradient (BitFit, a LoRA base) therefore stays slimact's: running F.linear
    # there (as e0942cf did for every frozen weight) kept 2.6 MB more here, the frozen weights' bf16 size.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    for layer in (plain[2], plain[4]):
        layer.weight.requires_grad_(False)
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    x = torch.randn(4, 32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = {name: slimact.profile(m, x, loss_fn=lambda o: o.float().square().mean()).by_kind["linear"]
                for name, m in (("plain", plain), ("slim", slim))}
    frozen_bf16 = sum(layer.weight.numel() * 2 for layer in (plain[2], plain[4]))
    assert kept["slim"] < frozen_bf16 <= kept["plain"]


@pytest.mark.parametrize("policy", ["int8", "mesa"])
def test_hf_conv1d_refuses_an_input_it_cannot_view_as_the_plain_one_does(policy):
    # Hugging Face's Conv1D computes on x.view(-1, in): a transposed [B, T, C] input raises there. Converted, it had
    # computed the product (a differential fuzzer: "plain raised, the converted model computed").
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    plain = Conv1D(8, 8)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert type(slim).__module__.startswith("slimact")
    x = torch.randn(2, 8, 3, requires_grad=True).transpose(1, 2)  # [2, 3, 8], no view flattens it
    with pytest.raises(RuntimeError, match="view size is not compatible") as want:
        plain(x)
    with pytest.raises(RuntimeError, match="view size is not compatible") as got:
        slim(x)
    assert str(got.value) == str(want.value)
    y = x.contiguous()  # (one that does: slimact's product, plain's output)
    assert torch.equal(slim(y), plain(y))


def _gnn(conv: str):
    """Three PyTorch Geometric convs (their projections are PyG's own ``Linear``) with ReLUs, and a small graph."""
    geometric = pytest.importorskip("torch_geometric.nn")
    make = {"gcn": lambda i, o: geometric.GCNConv(i, o), "sage": lambda i, o: geometric.SAGEConv(i, o),
            "gat": lambda i, o: geometric.GATConv(i, o // 4, heads=4),
            "mlp": None}[conv]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList([make(32, 64), make(64, 64), make(64, 8)])

        def forward(self, x, edges):
            for i, layer in enumerate(self.convs):
                x = layer(x, edges)
                x = x.relu() if i < 2 else x
            return x

    torch.manual_seed(0)
    if conv == "mlp":  # PyG's MLP: its Linears beside BatchNorm and ReLU modules
        return geometric.MLP([32, 64, 64, 8], norm="batch_norm"), (torch.randn(300, 32),)
    return Net(), (torch.randn(300, 32), torch.randint(0, 300, (2, 1500)))


def _step(model, inputs):
    model(*inputs).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("conv", ["gcn", "sage", "gat", "mlp"])
def test_pytorch_geometric_linears_are_converted_and_train_as_plain(conv, monkeypatch):
    from torch_geometric.nn.dense.linear import Linear as PyGLinear

    plain, inputs = _gnn(conv)
    model = slimact.convert(copy.deepcopy(plain), "int8")
    linears = [m for m in model.modules() if isinstance(m, PyGLinear)]
    assert linears and all(type(m).__module__ == "slimact.nn.linear" for m in linears)
    assert slimact.summary(model).converted["linear"] == len(linears)
    torch.testing.assert_close(model(*inputs), plain(*inputs), rtol=0, atol=0)
    exact, approx = _step(plain, inputs), _step(model, inputs)
    assert_gradients_close(exact, approx, min_cosine=0.999)
    # what the Linears keep: their 8-bit inputs, a quarter of plain's fp32 copies (in the MLP, beside its BatchNorms
    # and ReLUs, which plain charges the Linears' shared inputs to, the whole model's bytes)
    kept, plain_kept = (slimact.profile(m, inputs) for m in (model, plain))
    if conv == "mlp":
        assert kept.activation_bytes <= 0.3 * plain_kept.activation_bytes
    else:
        assert kept.by_kind["linear"] <= 0.3 * plain_kept.by_kind["linear"]
        assert kept.activation_bytes < plain_kept.activation_bytes
    # a deep copy stays converted, and computes the same, also where PyG defines Linear.__deepcopy__ as some releases
    # do (a fresh plain Linear, its parameters copied: 2.8.1 does not)
    fresh = []

    def fresh_linear(self, memo):
        fresh.append(self)
        out = PyGLinear(self.in_channels, self.out_channels, self.bias is not None)
        out.weight, out.bias = copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo)
        return out

    monkeypatch.setattr(PyGLinear, "__deepcopy__", fresh_linear, raising=False)
    copy.deepcopy(plain)
    assert len(fresh) == len(linears)  # (the plain model's Linears copy themselves that way)
    twin = copy.deepcopy(model)
    assert [type(m) for m in twin.modules()] == [type(m) for m in model.modules()]
    for p in model.parameters():
        p.grad = None
    assert_gradients_equal(_step(model, inputs), _step(twin, inputs))
    # revert gives PyG's class back, the state dict unchanged
    slimact.revert(model)
    assert all(type(m) is PyGLinear for m in model.modules() if isinstance(m, PyGLinear))
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_a_pytorch_geometric_linear_with_its_own_forward_is_left_alone():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn.dense.linear import Linear as PyGLinear

    class Scaled(PyGLinear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = slimact.convert(nn.Sequential(Scaled(8, 8), nn.GELU(), PyGLinear(8, 4)), "int8")
    assert type(model[0]) is Scaled and type(model[2]).__module__ == "slimact.nn.linear"
    assert "Scaled subclasses torch_geometric.nn.dense.linear.Linear with its own forward" in str(
        slimact.summary(model))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_inputs_run_as_plain(layout):
    # A converted Linear packed a sparse input ("Cannot access storage of SparseTensorImpl"), a routed product in
    # attention code a sparse adjacency ("reshape is not implemented for sparse tensors"), where plain trains: PyG's
    # GCN on sparse bag-of-words node features, now that PyG's Linear is converted (a review).
    def sparse(t):
        return t.to_sparse() if layout == "coo" else t.to_sparse_csr()

    class GraphAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.q = nn.Linear(32, 8), nn.Linear(8, 8)

        def forward(self, adj, x):
            h = self.q(self.proj(x))
            return (adj @ h).softmax(-1) @ h.transpose(0, 1) @ h

    torch.manual_seed(0)
    x = sparse((torch.rand(12, 32) < 0.2).float())
    adj = sparse((torch.rand(12, 12) < 0.3).float())
    plain = GraphAttention()
    for policy in ("tempo", "int8", "mesa"):
        model = slimact.convert(copy.deepcopy(plain), policy)
        for m in (plain, model):
            m.zero_grad()
        y0, y1 = plain(adj, x), model(adj, x)
        torch.testing.assert_close(y1, y0, rtol=0, atol=0)
        y0.square().sum().backward()
        y1.square().sum().backward()
        assert_gradients_close({n: p.grad for n, p in plain.named_parameters()},
                               {n: p.grad for n, p in model.named_parameters()}, min_cosine=0.999)
    if layout == "coo":
        geometric = pytest.importorskip("torch_geometric.nn")
        gcn = geometric.GCNConv(32, 8)
        model = slimact.convert(copy.deepcopy(gcn), "int8")
        edges = torch.randint(0, 12, (2, 40))
        torch.testing.assert_close(model(x, edges), gcn(x, edges), rtol=0, atol=0)
        model(x, edges).sum().backward()


class _TimeConditioned(nn.Module):
    """A diffusion model's timestep MLP (one row a sample) adding its embedding to a block's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1, self.act, self.linear_2 = nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 64)
        self.proj = nn.Linear(64, 64)

    def forward(self, x, t):
        half = torch.exp(-math.log(10000) * torch.arange(16) / 16)
        emb = torch.cat([torch.sin(t[:, None] * half), torch.cos(t[:, None] * half)], -1)  # [B, 32]
        return self.proj(x) + self.linear_2(self.act(self.linear_1(emb)))[:, None]  # ([B, 64]: a row a sample)


def test_a_layer_of_few_rows_packs_with_its_own_range_under_running_estimates():
    # A timestep MLP at batch 2 under "mesa": an estimate made on other batches' two rows clips this one's range
    # (plain's and the converted gradients at the same weights at cosine 0.98 over 8 Adam steps with fresh timesteps;
    # diffusers' conditioned models failed check at 0.80-0.94; a sweep, 2026-12-07). Below FEW_ROWS rows a channel a
    # layer packs with its own range, as norms did; at more, the running estimate (proj: 32 rows).
    from slimact._metrics import cosine

    torch.manual_seed(0)
    base = _TimeConditioned()
    slim, plain = slimact.convert(copy.deepcopy(base), "mesa"), copy.deepcopy(base)
    opt = torch.optim.Adam(slim.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        x, t = torch.randn(2, 16, 64, generator=gen), torch.randint(0, 1000, (2,), generator=gen).float()
        w = torch.randn(2, 16, 64, generator=gen)
        plain.load_state_dict(slim.state_dict())
        for model in (plain, slim):
            model.zero_grad()
            (model(x, t) * w).sum().backward()
        for name, p in slim.named_parameters():
            assert cosine(plain.get_parameter(name).grad, p.grad) >= 0.999, name
        opt.step()
    assert sorted({n.partition(".")[0] for n in estimates(slim)}) == ["proj"]
