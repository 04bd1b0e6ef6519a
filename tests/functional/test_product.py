"""The product of a gate written in model code (``slimact.functional.product``): PyTorch's forward, both factors
kept with the policy's codes, an activation's output through its input's codes (no bytes of its own); and the
broadcast product of a norm's output (adaLN's modulation), the norm's pack reused, the small factor exact."""

from __future__ import annotations

import copy

import pytest
import torch

import slimact
from _harness import backward_nodes, check_against_plain
from slimact._metrics import cosine, sqnr_db
from slimact.functional.activation import activation, output_form
from slimact.functional.norm import norm
from slimact.functional.product import broadcast_big, broadcast_product, product
from slimact.policy import resolve

CFG = resolve("int8").quant_config("silu", 3)


def _factors(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 16, 64, generator=gen) * 2).to(dtype).requires_grad_(True)
    b = torch.randn(4, 16, 64, generator=gen).to(dtype).requires_grad_(True)
    return x, b


def _grads(fn, x, b, seed=1):
    y = fn(x, b)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y)
    return (y.detach(), *torch.autograd.grad(y, (x, b), grad_y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_forward_is_pytorchs_and_the_gradients_are_close(dtype):
    x, b = _factors(dtype)
    y0, gx0, gb0 = _grads(lambda x, b: torch.nn.functional.silu(x) * b, x, b)
    y1, gx1, gb1 = _grads(lambda x, b: product(activation(x, "silu", CFG, fn=torch.nn.functional.silu), b, CFG), x, b)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    assert cosine(gx0, gx1) >= 0.999 and cosine(gb0, gb1) >= 0.999


def test_an_activations_output_costs_no_bytes_of_its_own():
    # Plain keeps x (the SiLU's input), silu(x) and b: 12 bytes per element in fp32. Here x's codes serve both the
    # SiLU and the product's rebuilt silu(x); b's codes are the product's own: 2 bytes per element and the scales.
    x, b = _factors()

    class Gate(torch.nn.Module):
        def forward(self, x, b):
            return product(activation(x, "silu", CFG, fn=torch.nn.functional.silu), b, CFG)

    report = slimact.profile(Gate(), (x, b), loss_fn=lambda y: y.sum())  # (a sum keeps nothing)
    codes = 2 * x.numel()
    assert codes <= report.activation_bytes < 1.1 * codes


def test_only_what_a_gradient_needs_is_kept():
    x, b = _factors()
    b = b.detach()  # (b needs no gradient: a's factor b is kept, silu(x) is not needed)
    y = product(activation(x, "silu", CFG, fn=torch.nn.functional.silu), b, CFG)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert saved and all(t.dtype in (torch.uint8, torch.int8, torch.float32) for t in saved)
    assert sum(t.numel() * t.element_size() for t in saved) < 1.1 * b.numel()


def test_the_square_of_one_factor_packs_it_once():
    x, _ = _factors()
    a = activation(x, "gelu", CFG, fn=torch.nn.functional.gelu)
    assert output_form(a) == "gelu"
    (g0,) = torch.autograd.grad((torch.nn.functional.gelu(x) ** 2).sum(), x)
    (g1,) = torch.autograd.grad(product(a, a, CFG).sum(), x)
    assert cosine(g0, g1) >= 0.999


def test_factors_of_other_shapes_or_dtypes_are_refused():
    x, b = _factors()
    with pytest.raises(ValueError, match="one shape and dtype"):
        product(x, b[..., :1], CFG)
    with pytest.raises(ValueError, match="one shape and dtype"):
        product(x, b.double(), CFG)


# ------------------------------------------------------------------------------------------- broadcast products
# adaLN's modulation (DiT, SD3, Flux, PixArt): norm(h) * (1 + scale[:, None]) + shift[:, None], the large factor a
# norm's output, the small one broadcast to it.

LN_CFG = resolve("int8").quant_config("layernorm", 3)


def _norm_and_scale(shape, dtype_a=torch.float32, dtype_b=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 16, 64, generator=gen) * 2 + 0.5).to(dtype_a).requires_grad_(True)
    s = (torch.randn(shape, generator=gen) * 0.3).to(dtype_b).requires_grad_(True)
    return x, s


def _modulate(norm_fn, swapped):
    def fn(x, s):
        h, b = norm_fn(x), 1 + s
        return b * h if swapped else h * b
    return fn


def _slim_modulate(swapped):
    def fn(x, s):
        h, b = norm(x, None, None, 1e-6, LN_CFG), 1 + s
        return broadcast_product(b, h, LN_CFG) if swapped else broadcast_product(h, b, LN_CFG)
    return fn


def _plain_norm(x):
    return torch.nn.functional.layer_norm(x, [x.shape[-1]], eps=1e-6)


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("shape", [(4, 1, 64), (1, 1, 64), (64,), (4, 16, 1)])
def test_a_norms_output_times_a_broadcast_factor(shape, swapped):
    # [B, 1, C]: adaLN; [1, 1, C] and [C]: one scale for the batch; [B, T, 1]: a per-token scale (its gradient sums
    # over the channels; the Function computes it within the floors here, but the route leaves it as written: a norm
    # after the product makes that sum a cancellation, see test_a_mix_of_normed_streams_runs_as_written).
    x, s = _norm_and_scale(shape)
    y0, gx0, gs0 = _grads(_modulate(_plain_norm, swapped), x, s)
    y1, gx1, gs1 = _grads(_slim_modulate(swapped), x, s)
    assert torch.equal(y1, y0)
    assert gs1.shape == s.shape and gs1.dtype == s.dtype
    assert cosine(gx0, gx1) >= 0.999 and cosine(gs0, gs1) >= 0.999
    assert sqnr_db(gs0, gs1) >= 30 and sqnr_db(gx0, gx1) >= 30


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("swapped", [False, True])
def test_the_broadcast_backward_is_pytorchs_when_kept_exact(dtypes, swapped):
    # Kept exact (cfg None), the Function's gradients are PyTorch's bit for bit, dtype promotion included (the
    # product in the promoted dtype, summed to the small factor's shape, then cast: autograd's order); 8-bit,
    # grad_a is still exact and grad_b within the floors.
    a, b = _norm_and_scale((4, 1, 64), *dtypes)

    def written(a, b):
        return b * a if swapped else a * b

    y0, ga0, gb0 = _grads(written, a, b)
    for cfg in (None, LN_CFG):
        y1, ga1, gb1 = _grads(lambda a, b, cfg=cfg: broadcast_product(*((b, a) if swapped else (a, b)), cfg), a, b)
        assert torch.equal(y1, y0) and y1.dtype == y0.dtype
        assert ga1.dtype == a.dtype and gb1.dtype == b.dtype and gb1.shape == b.shape
        assert torch.equal(ga1, ga0)
        if cfg is None:
            assert torch.equal(gb1, gb0)
        else:
            assert cosine(gb0, gb1) >= 0.999 and sqnr_db(gb0, gb1) >= 30


def test_a_norms_output_costs_no_bytes_of_its_own():
    # The norm keeps its output's codes (1 byte per element, one scale per channel); the product's a is that very
    # pack, and it keeps b ([4, 1, 64] fp32) of its own. Plain keeps the norm's output in fp32 for the scale's
    # gradient (and the norm's input for its own).
    x, s = _norm_and_scale((4, 1, 64))

    class Modulated(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x, s):
            return self.fn(x, s)

    def kept(fn):
        return slimact.profile(Modulated(fn), (x, s), loss_fn=lambda y: y.sum()).activation_bytes

    norm_only = kept(lambda x, s: norm(x, None, None, 1e-6, LN_CFG) + s)
    assert kept(_slim_modulate(False)) - norm_only == s.numel() * 4
    assert kept(_modulate(_plain_norm, False)) - kept(lambda x, s: _plain_norm(x) + s) >= x.numel() * 4
    h = norm(x, None, None, 1e-6, LN_CFG)
    y = broadcast_product(h, 1 + s, LN_CFG)

    def codes(t):
        saved = [u for u in t.grad_fn.saved_tensors if u is not None and u.dtype == torch.uint8]
        return [u.untyped_storage().data_ptr() for u in saved]

    mine, norms = codes(y), codes(h)
    assert mine and norms and set(mine) <= set(norms)


def test_a_broadcast_product_keeps_only_what_a_gradient_needs():
    x, s = _norm_and_scale((4, 1, 64))
    a = x.detach().requires_grad_(True)
    y = broadcast_product(a, (1 + s).detach(), LN_CFG)  # b needs no gradient: a's codes are not needed
    assert [t.shape for t in y.grad_fn.saved_tensors if t is not None] == [torch.Size([4, 1, 64])]
    y = broadcast_product(a.detach(), 1 + s, LN_CFG)  # a needs none: b is not kept
    assert all(t is None or t.dtype != torch.float32 or t.numel() < a.numel() // 4 for t in y.grad_fn.saved_tensors)
    assert all(t is None or t.shape != (4, 1, 64) for t in y.grad_fn.saved_tensors)


@pytest.mark.parametrize(("x", "y"), [((4, 16, 64), ()), ((4, 1, 64), (1, 16, 64)), ((1, 64), (64,)),
                                      ((4, 16, 64), (4, 16, 64)), ((4, 16, 64), (3, 1, 64))])
def test_which_factor_is_large_is_not_guessed(x, y):
    # A 0-dim factor, both broadcast, equal element counts in other shapes, equal shapes, shapes that do not
    # broadcast: no large factor (the route leaves such calls as written).
    a, b = torch.randn(x), torch.randn(y)
    assert broadcast_big(a, b) is None and broadcast_big(b, a) is None
    with pytest.raises(ValueError, match="broadcasts to the other"):
        broadcast_product(a, b, LN_CFG)
    assert broadcast_big(torch.randn(4, 16, 64), torch.randn(4, 1, 64)) == 0
    assert broadcast_big(torch.randn(4, 1, 64), torch.randn(4, 16, 64)) == 1


# The route (slimact.nn.routing): `a * b` in model code, a the output of a norm slimact computed.


class _Modulated(torch.nn.Module):
    """adaLN as DiT writes it (``modulate``), after a norm of one of several kinds, in either order."""

    def __init__(self, kind="layernorm-no-affine", swapped=False, channels=32):
        super().__init__()
        self.kind, self.swapped = kind, swapped
        self.norm = {"layernorm-no-affine": lambda: torch.nn.LayerNorm(channels, elementwise_affine=False, eps=1e-6),
                     "layernorm": lambda: torch.nn.LayerNorm(channels), "rmsnorm": lambda: torch.nn.RMSNorm(channels),
                     "groupnorm": lambda: torch.nn.GroupNorm(4, channels)}[kind]()
        self.ada = torch.nn.Linear(16, 2 * channels)
        self.out = torch.nn.Linear(channels, channels)

    def forward(self, x, c):
        shift, scale = self.ada(torch.nn.functional.silu(c)).chunk(2, dim=1)
        if self.kind == "groupnorm":  # a UNet ResNet block's scale-shift: [N, C, H, W] by [N, C, 1, 1]
            scale, shift = scale[:, :, None, None], shift[:, :, None, None]
        else:
            scale, shift = scale.unsqueeze(1), shift.unsqueeze(1)
        h = self.norm(x)
        h = (1 + scale) * h if self.swapped else h * (1 + scale)
        h = h + shift
        return self.out(h.transpose(1, -1) if self.kind == "groupnorm" else h)


def _routed(y) -> bool:
    return any(type(n).__name__ == "_BroadcastProductFunctionBackward" for n in backward_nodes(y))


def _inputs(kind):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((2, 32, 4, 4) if kind == "groupnorm" else (2, 16, 32), generator=gen) * 2 + 0.5
    return x, torch.randn(2, 16, generator=gen)


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("kind", ["layernorm-no-affine", "layernorm", "rmsnorm", "groupnorm"])
def test_adaln_modulation_keeps_the_norms_codes(kind, swapped):
    torch.manual_seed(0)
    plain = _Modulated(kind, swapped).train()
    x, c = _inputs(kind)
    x.requires_grad_()  # (the norm's input needs a gradient, as in a model: else slimact's norm keeps nothing)
    slim = check_against_plain(plain, x, c, policy="int8")  # (forward bit for bit; every gradient >= 30 dB)
    assert _routed(slim(x, c))
    # Nothing [B, T, C] in fp32: the norm's output costs no bytes beyond the norm's own codes.
    entries = slimact.profile(slim, (x, c)).entries
    assert not [e for e in entries if e.shape == tuple(x.shape) and e.dtype == torch.float32]
    assert any(e.shape == tuple(x.shape) and e.dtype == torch.float32
               for e in slimact.profile(plain, (x, c)).entries)


def test_adaln_modulation_under_autocast():
    # bf16 autocast: the norm's output fp32 (layer_norm runs in fp32), 1 + scale bf16 (the linear layer's output):
    # the product promotes to fp32, as written; routed, its gradients cast back to each factor's dtype.
    torch.manual_seed(0)
    plain = _Modulated().train()
    slim = slimact.convert(copy.deepcopy(plain), "int8").train()
    x, c = _inputs("layernorm")
    outs, grads = [], []
    for model in (plain, slim):
        xs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(xs, c)
        if model is slim:
            assert _routed(y)
        y.float().backward(torch.ones_like(y, dtype=torch.float32))
        outs.append(y.detach())
        grads.append([xs.grad, *(p.grad for p in model.parameters())])
    assert torch.equal(outs[0], outs[1])
    assert all(cosine(g0, g1) >= 0.999 for g0, g1 in zip(*grads, strict=True))


def test_under_tempo_the_modulation_runs_as_written():
    # The lossless norm keeps its output itself, the tensor autograd keeps for the scale's gradient: one storage,
    # nothing to save, nothing routed.
    torch.manual_seed(0)
    plain = _Modulated().train()
    x, c = _inputs("layernorm")
    x.requires_grad_()
    slim = slimact.convert(copy.deepcopy(plain), "tempo").train()
    assert not _routed(slim(x, c))
    assert slimact.profile(slim, (x, c)).by_module["(model)"] == 2 * 1 * 32 * 4  # (1 + scale) alone
    assert slimact.profile(plain, (x, c)).by_module["(model)"] == 2 * 1 * 32 * 4 + x.numel() * 4  # and the output


def test_a_guarded_norm_keeps_its_input_and_the_product_packs_the_output():
    # A channel with weight 0: the norm cannot rebuild its input from its output and keeps its input (8-bit); the
    # product packs the output itself, 1 byte per element where plain keeps 4.
    torch.manual_seed(0)
    plain = _Modulated("layernorm").train()
    with torch.no_grad():
        plain.norm.weight[3] = 0.0
    x, c = _inputs("layernorm")
    x.requires_grad_()
    slim = check_against_plain(plain, x, c, policy="int8")
    assert _routed(slim(x, c))
    assert not [e for e in slimact.profile(slim, (x, c)).entries
                if e.shape == tuple(x.shape) and e.dtype == torch.float32]


class _Untaken(torch.nn.Module):
    """Broadcast products whose large factor no slimact layer keeps, that keep nothing worth routing, or whose small
    factor's gradient would sum along the norm's row."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.se = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):  # x: [B, 8, 4, 4]
        h = self.conv(x)
        pooled = h.mean((2, 3))
        if self.how == "squeeze-excitation":  # a conv's output times a sigmoid gate
            return h * torch.sigmoid(self.se(pooled))[:, :, None, None]
        if self.how == "silu-gate":  # an activation's output times a broadcast gate (not taken either)
            return torch.nn.functional.silu(h) * torch.sigmoid(self.se(pooled))[:, :, None, None]
        t = h.flatten(2).transpose(1, 2)  # [B, 16, 8]
        if self.how == "dit-gate":  # DiT's gate: a linear layer's output times gate[:, None]
            return t + self.se(pooled).unsqueeze(1) * self.proj(self.norm(t))
        if self.how == "mask":  # attention's probs * mask: the small factor needs no gradient
            probs = torch.softmax(t @ t.transpose(1, 2), -1)
            return probs * (torch.arange(16) % 3 != 0).float()[None, None]
        if self.how == "mask-on-norm":  # a norm's output times a constant mask: plain keeps only the mask
            return self.norm(t) * (torch.arange(16) % 3 != 0).float()[None, :, None]
        if self.how == "per-token":  # a norm's output times a [B, T, 1] scale: its gradient sums along the row
            return self.norm(t) * torch.sigmoid(self.proj(t)[..., :1])
        return self.norm(t) * self.se(pooled).mean()  # "0-dim": a 0-dim factor


@pytest.mark.parametrize("how", ["squeeze-excitation", "silu-gate", "dit-gate", "mask", "mask-on-norm", "0-dim",
                                 "per-token"])
def test_broadcast_products_the_route_does_not_take_run_as_written(how):
    torch.manual_seed(0)
    plain = _Untaken(how).train()
    x = torch.randn(2, 8, 4, 4, generator=torch.Generator().manual_seed(4))
    slim = check_against_plain(plain, x, policy="int8")
    assert not _routed(slim(x.requires_grad_()))


class _MixOfStreams(torch.nn.Module):
    """A learned mix of normed streams into an RMSNorm (a hyper-connection head with a norm per stream): the mix's
    weights, one per stream, ``[B, T, K, 1]``, times the streams' norm's output ``[B, T, K, C]``."""

    def __init__(self, k=4, c=64):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.randn(k, k * c) * 0.02)
        self.base = torch.nn.Parameter(torch.zeros(k))
        self.pre_norm = torch.nn.LayerNorm(c, elementwise_affine=False)
        self.norm = torch.nn.RMSNorm(c, eps=1e-6)

    def forward(self, streams):
        pre = torch.sigmoid(torch.nn.functional.linear(streams.flatten(2), self.mix) + self.base)
        return self.norm((pre.unsqueeze(-1) * self.pre_norm(streams)).sum(dim=2))


def test_a_mix_of_normed_streams_runs_as_written():
    # The weights' gradient, sum_c grad_h * xn_k, is the small remainder of a cancellation (the RMSNorm's gradient is
    # orthogonal to h, and the streams are nearly parallel to it). Routed, with xn_k from the norm's 8-bit codes (and
    # the RMSNorm missing the mix behind slimact's product node), it was at cosine 0.84 (mix) and 0.73 (base); a
    # factor constant along the norm's channels is left as written, and the RMSNorm sees the mix.
    torch.manual_seed(0)
    model = _MixOfStreams()
    h = torch.randn(2, 32, 1, 64)
    streams = (h.expand(-1, -1, 4, -1) + 0.01 * torch.randn(2, 32, 4, 64)).requires_grad_()
    proj = torch.randn(64)
    grads = []
    for m in (model, slimact.convert(copy.deepcopy(model), "int8")):
        y = m(streams)
        assert not _routed(y)
        (y @ proj).pow(2).sum().backward()
        grads.append((m.mix.grad, m.base.grad))
    for exact, approx in zip(*grads, strict=True):
        assert cosine(exact, approx) >= 0.999


def test_a_norm_sees_a_mix_made_by_the_broadcast_product():
    # Weights per stream and channel, [K, C]: routed (their gradient sums over rows); the norm the mix feeds finds
    # the mix behind slimact's product node and keeps its tensors exact, as behind PyTorch's mul.
    from slimact.functional.norm import _learned_mix

    s = norm(torch.randn(2, 8, 4, 16, requires_grad=True), None, None, 1e-6, LN_CFG)
    w = torch.randn(4, 16, requires_grad=True)
    assert _learned_mix(broadcast_product(s, w, LN_CFG).sum(2)) and _learned_mix((s * w).sum(2))


class AdaLayerNormZero(torch.nn.Module):
    """diffusers' ``AdaLayerNormZero`` (DiT's and SD3's norm1 in diffusers; ``emb`` given), which modulates its norm's
    output in its own forward: a module whose class is named a norm, in whose code the routing leaves same-shape
    products as written (a gated norm's)."""

    def __init__(self, embedding_dim):
        super().__init__()
        self.silu = torch.nn.SiLU()
        self.linear = torch.nn.Linear(embedding_dim, 6 * embedding_dim, bias=True)
        self.norm = torch.nn.LayerNorm(embedding_dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class _DiffusersBlock(torch.nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.norm1 = AdaLayerNormZero(c)
        self.ff = torch.nn.Linear(c, c)

    def forward(self, x, emb):
        h, gate, *_ = self.norm1(x, emb)
        return x + gate.unsqueeze(1) * self.ff(h)


def test_adaln_in_a_norm_modules_own_code():
    torch.manual_seed(0)
    plain = _DiffusersBlock().train()
    x, c = _inputs("layernorm")
    c = torch.cat([c, c], 1)
    x.requires_grad_()
    slim = check_against_plain(plain, x, c, policy="int8")
    assert _routed(slim(x, c))
    after = slimact.profile(slim, (x, c)).by_module["norm1"]
    assert after == slimact.profile(plain, (x, c)).by_module["norm1"] - x.numel() * 4  # (its fp32 output)


class _Reused(torch.nn.Module):
    """A norm's output modulated twice (SD3's joint blocks, AdaLayerNormZero: one for attention, one for the MLP), or
    changed in place out of autograd's sight before its product, or times an expanded view of a parameter."""

    def __init__(self, how, channels=32):
        super().__init__()
        self.how = how
        self.norm = torch.nn.LayerNorm(channels, elementwise_affine=False)
        self.ada = torch.nn.Linear(16, 2 * channels)
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, channels))
        self.out = torch.nn.Linear(channels, channels)

    def forward(self, x, c):
        s1, s2 = self.ada(c).unsqueeze(1).chunk(2, -1)
        h = self.norm(x)
        if self.how == "twice":
            return self.out(h * (1 + s1)) + (1 + s2) * h
        if self.how == "changed-in-place":  # (the norm's pack is of the values before: the product packs its own)
            with torch.no_grad():
                h.add_(0.5)
            return self.out(h * (1 + s1))
        return self.out(h * self.gain.expand(x.shape[0], 1, -1))  # "expanded-parameter"


@pytest.mark.parametrize("policy", ["int8", "mesa"])
@pytest.mark.parametrize("how", ["twice", "changed-in-place", "expanded-parameter"])
def test_a_norms_output_reused_changed_or_times_a_view(how, policy):
    torch.manual_seed(0)
    plain = _Reused(how).train()
    x, c = _inputs("layernorm")
    x.requires_grad_()
    slim = check_against_plain(plain, x, c, policy=policy)  # (forward bit for bit; every gradient >= 30 dB)
    assert _routed(slim(x, c))
