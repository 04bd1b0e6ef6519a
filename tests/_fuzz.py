"""Random small ``nn.Module`` programs from a grammar of building blocks, for the differential fuzzer over
``convert`` (``tests/test_fuzz.py``).

Every block maps ``[B, T, D] -> [B, T, D]`` (fp32). ``build(seed)`` returns ``(model, make_input, call, loss_of,
desc)``: ``make_input(step)`` the forward's input (the sequence length may change at step 2), ``call(model, x)`` the
forward (with labels where the program ends in a loss), ``loss_of(out)`` a scalar, ``desc`` the grammar elements
drawn. A leaf block may be one of the hand-picked edge cases at the end of this file (``CASES``).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.utils import parametrize

# ----------------------------------------------------------------------------------------------- linears


class ScaledLinear(nn.Linear):
    def __init__(self, i, o, bias=True, scale=0.5):
        super().__init__(i, o, bias=bias)
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale


class LoRALinear(nn.Linear):
    def __init__(self, i, o, bias=True, r=2, alpha=4.0):
        super().__init__(i, o, bias=bias)
        self.lora_A = nn.Parameter(torch.randn(r, i) * 0.3)
        self.lora_B = nn.Parameter(torch.randn(o, r) * 0.3)
        self.scaling = alpha / r

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class TransformedWeightLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight * 0.5 + 0.01, self.bias)


class ExtraParamLinear(nn.Linear):
    """Subclass with an extra parameter, forward not overridden; the parent uses .extra itself."""

    def __init__(self, i, o, bias=True):
        super().__init__(i, o, bias=bias)
        self.extra = nn.Parameter(torch.randn(o) * 0.1)


class ExtraParamUser(nn.Module):
    def __init__(self, d, bias):
        super().__init__()
        self.lin = ExtraParamLinear(d, d, bias)

    def forward(self, x):
        return self.lin(x) + self.lin.extra


class RenamedLinear(nn.Linear):
    """Subclass with no forward of its own."""


class FLinearInCode(nn.Module):
    def __init__(self, d, bias):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
        self.b = nn.Parameter(torch.randn(d) * 0.1) if bias else None

    def forward(self, x):
        return F.linear(x, self.w, self.b)


class SharedTwice(nn.Module):
    def __init__(self, d, bias, mode):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=bias)
        self.mode = mode

    def forward(self, x):
        if self.mode == 0:
            return self.lin(torch.tanh(self.lin(x)))
        return self.lin(x) + self.lin(x * 0.5 + 1.0)


class TiedPair(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=True)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.7))

    def forward(self, X):
        return X * self.s


def make_parametrized_linear(d, bias, rng):
    lin = nn.Linear(d, d, bias=bias)
    k = rng.randrange(3)
    if k == 0:
        parametrize.register_parametrization(lin, "weight", Symmetric())
        return lin, "parametrize_symmetric"
    if k == 1:
        parametrize.register_parametrization(lin, "weight", Scaled())
        return lin, "parametrize_scaled_param"
    lin = torch.nn.utils.parametrizations.weight_norm(lin)
    return lin, "weight_norm"


# ----------------------------------------------------------------------------------------------- norms


class T5RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x


class LlamaRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Fp32LayerNorm(nn.LayerNorm):
    def forward(self, x):
        out = F.layer_norm(
            x.float(),
            self.normalized_shape,
            self.weight.float() if self.weight is not None else None,
            self.bias.float() if self.bias is not None else None,
            self.eps,
        )
        return out.type_as(x)


class CastLayerNorm(nn.LayerNorm):
    """Upcasting subclass that calls super().forward."""

    def forward(self, x):
        return super().forward(x.float()).type_as(x)


class HandLayerNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class FunctionalLN(nn.Module):
    """F.layer_norm / F.rms_norm called in model code (no weights, or weights)."""

    def __init__(self, d, kind, affine):
        super().__init__()
        self.kind = kind
        self.d = d
        self.weight = nn.Parameter(torch.ones(d)) if affine else None
        self.bias = nn.Parameter(torch.zeros(d)) if (affine and kind == "ln") else None

    def forward(self, x):
        if self.kind == "ln":
            return F.layer_norm(x, (self.d,), self.weight, self.bias, 1e-5)
        return F.rms_norm(x, (self.d,), self.weight, 1e-6)


def randomise_norm_params(m, rng, zeros=False):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for n, p in m.named_parameters(recurse=False):
        with torch.no_grad():
            if n == "weight":
                if isinstance(m, GemmaRMSNorm):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                else:
                    p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)
                    if zeros:
                        p[::3] = 0.0
            elif n == "bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_norm(d, rng):
    k = rng.randrange(12)
    if k == 0:
        m, tag = nn.LayerNorm(d), "LayerNorm"
    elif k == 1:
        m, tag = nn.LayerNorm(d, elementwise_affine=False), "LayerNorm_noaffine"
    elif k == 2:
        m, tag = nn.LayerNorm(d, bias=False), "LayerNorm_nobias"
    elif k == 3:
        m, tag = nn.RMSNorm(d, eps=rng.choice([None, 1e-6, 1e-5])), "RMSNorm"
    elif k == 4:
        m, tag = nn.RMSNorm(d, elementwise_affine=False), "RMSNorm_noaffine"
    elif k == 5:
        m, tag = T5RMSNorm(d), "T5RMSNorm"
    elif k == 6:
        m, tag = LlamaRMSNorm(d), "LlamaRMSNorm"
    elif k == 7:
        m, tag = GemmaRMSNorm(d), "GemmaRMSNorm"
    elif k == 8:
        m, tag = Fp32LayerNorm(d), "Fp32LayerNorm"
    elif k == 9:
        m, tag = CastLayerNorm(d), "CastLayerNorm"
    elif k == 10:
        m, tag = HandLayerNorm(d), "HandLayerNorm"
    else:
        kind = rng.choice(["ln", "rms"])
        aff = rng.random() < 0.5
        m, tag = FunctionalLN(d, kind, aff), f"F.{kind}_norm_affine{int(aff)}"
    zeros = rng.random() < 0.15
    randomise_norm_params(m, rng, zeros)
    return m, tag + ("_zeroweights" if zeros else "")


# ----------------------------------------------------------------------------------------------- activations


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Swish(nn.Module):
    def __init__(self, beta=1.0):
        super().__init__()
        self.beta = beta

    def forward(self, x):
        return x * torch.sigmoid(self.beta * x)


class ClippedGELU(nn.Module):
    def forward(self, x):
        return torch.clip(F.gelu(x), -10, 10)


class FGelu(nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, approximate=self.approximate)


class FSilu(nn.Module):
    def forward(self, x):
        return F.silu(x)


class FRelu(nn.Module):
    def forward(self, x):
        return F.relu(x)


class ReluSquared(nn.Module):
    def forward(self, x):
        return F.relu(x).square()


class InplaceReluCode(nn.Module):
    def forward(self, x):
        return F.relu(x, inplace=True)


def make_act(rng):
    k = rng.randrange(18)
    table = [
        (lambda: nn.GELU(), "GELU"),
        (lambda: nn.GELU(approximate="tanh"), "GELU_tanh"),
        (lambda: nn.SiLU(), "SiLU"),
        (lambda: nn.ReLU(), "ReLU"),
        (lambda: nn.ReLU(inplace=True), "ReLU_inplace"),
        (lambda: QuickGELU(), "QuickGELU"),
        (lambda: NewGELU(), "NewGELU"),
        (lambda: Swish(rng.choice([1.0, 1.702, 0.5])), "Swish"),
        (lambda: ClippedGELU(), "ClippedGELU"),
        (lambda: FGelu(rng.choice(["none", "tanh"])), "F.gelu"),
        (lambda: FSilu(), "F.silu"),
        (lambda: FRelu(), "F.relu"),
        (lambda: ReluSquared(), "ReluSquared"),
        (lambda: nn.Tanh(), "Tanh"),
        (lambda: nn.Mish(), "Mish"),
        (lambda: nn.SiLU(inplace=True), "SiLU_inplace"),
        (lambda: nn.LeakyReLU(0.1), "LeakyReLU"),
        (lambda: nn.Hardswish(), "Hardswish"),
    ]
    f, tag = table[k]
    return f(), tag


class ActBlock(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=rng.random() < 0.5)
        self.act, tag = make_act(rng)
        self.twice = rng.random() < 0.3
        desc.append("act:" + tag + ("_twice" if self.twice else ""))

    def forward(self, x):
        h = self.act(self.lin(x))
        if self.twice:
            h = self.act(h * 1.5 - 0.2)
        return h


# ----------------------------------------------------------------------------------------------- gated MLPs


class GatedMLP(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        hidden = rng.choice([d, 2 * d, d + 4])
        bias = rng.random() < 0.3
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d, bias=bias)
        self.act_fn, tag = make_act(rng)
        self.order = rng.randrange(4)
        desc.append(f"gated_mlp:{tag}:order{self.order}:bias{int(bias)}")

    def forward(self, x):
        if self.order == 0:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        if self.order == 1:
            return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))
        if self.order == 2:  # act applied to the projection named up: names lie
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))
        # scaled product (muP-like multiplier)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


class W123MLP(nn.Module):
    """Meta-llama naming: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, d, rng, desc):
        super().__init__()
        hidden = rng.choice([d, 2 * d])
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.fn = rng.choice(["silu", "gelu", "gelu_tanh"])
        desc.append(f"w123_mlp:{self.fn}")

    def forward(self, x):
        g = self.w1(x)
        a = F.silu(g) if self.fn == "silu" else F.gelu(g, approximate="tanh" if self.fn == "gelu_tanh" else "none")
        return self.w2(a * self.w3(x))


class FusedSwiGLU(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        hidden = rng.choice([d, 2 * d])
        self.gate_up_proj = nn.Linear(d, 2 * hidden, bias=rng.random() < 0.3)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.act_fn = nn.SiLU() if rng.random() < 0.6 else nn.GELU(approximate="tanh")
        self.swap = rng.random() < 0.3
        self.interleave = rng.random() < 0.2
        desc.append(f"fused_swiglu:swap{int(self.swap)}:interleave{int(self.interleave)}")

    def forward(self, x):
        gu = self.gate_up_proj(x)
        if self.interleave:
            gate, up = gu[..., ::2], gu[..., 1::2]
        else:
            gate, up = gu.chunk(2, dim=-1)
        if self.swap:
            gate, up = up, gate
        return self.down_proj(self.act_fn(gate) * up)


class GatedMLPDropout(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.gate_proj = nn.Linear(d, 2 * d, bias=False)
        self.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)
        self.act_fn = nn.GELU()
        self.dropout = nn.Dropout(rng.choice([0.0, 0.1, 0.3]))
        desc.append(f"gated_mlp_dropout:p{self.dropout.p}")

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class PlainMLP(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.act, tag = make_act(rng)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(rng.choice([0.0, 0.0, 0.2]))
        desc.append(f"plain_mlp:{tag}:p{self.drop.p}")

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


# ----------------------------------------------------------------------------------------------- attention


class SelfAttention(nn.Module):
    """Attention written in model code. Named *Attention so slimact routes its matmul/softmax."""

    def __init__(self, d, rng, desc, name_hint=True):
        super().__init__()
        heads = rng.choice([h for h in (1, 2, 4) if d % h == 0])
        kv_heads = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        bias = rng.random() < 0.5
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, self.kvh * self.hd, bias=bias)
        self.v_proj = nn.Linear(d, self.kvh * self.hd, bias=bias)
        self.o_proj = nn.Linear(d, d, bias=bias)
        self.mode = rng.choice(
            [
                "manual",
                "manual",
                "sdpa",
                "sdpa_causal",
                "sdpa_mask",
                "sdpa_gqa",
                "manual_dtype",
                "manual_baddbmm",
                "manual_einsum",
            ]
        )
        self.causal = rng.random() < 0.6
        self.mask_kind = rng.choice(["masked_fill", "additive", "bool_where"])
        self.p = rng.choice([0.0, 0.0, 0.0, 0.1])
        self.scale = rng.choice([None, 0.3])
        self.qk_norm = rng.random() < 0.2
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(self.hd)
            self.k_norm = nn.RMSNorm(self.hd)
        desc.append(
            f"attn:{self.mode}:h{heads}/{kv_heads}:causal{int(self.causal)}:{self.mask_kind}:p{self.p}"
            f":scale{self.scale}:qknorm{int(self.qk_norm)}"
        )

    def forward(self, x):
        B, T, D = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(self.hd)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if self.mode.startswith("sdpa"):
            if self.mode == "sdpa_gqa":
                o = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    is_causal=self.causal,
                    dropout_p=self.p if self.training else 0.0,
                    scale=self.scale,
                    enable_gqa=self.h != self.kvh,
                )
            else:
                if self.h != self.kvh:
                    k = k.repeat_interleave(self.h // self.kvh, dim=1)
                    v = v.repeat_interleave(self.h // self.kvh, dim=1)
                if self.mode == "sdpa_causal":
                    o = F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=self.scale, dropout_p=self.p if self.training else 0.0
                    )
                elif self.mode == "sdpa_mask":
                    mask = causal if self.causal else torch.rand(T, T, generator=torch.Generator().manual_seed(T)) > 0.3
                    mask = mask | torch.eye(T, dtype=torch.bool)
                    if self.mask_kind == "additive":
                        mask = torch.zeros(T, T, dtype=q.dtype).masked_fill(~mask, float("-inf"))
                    o = F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, scale=self.scale, dropout_p=self.p if self.training else 0.0
                    )
                else:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
        else:
            if self.h != self.kvh:
                k = k.repeat_interleave(self.h // self.kvh, dim=1)
                v = v.repeat_interleave(self.h // self.kvh, dim=1)
            if self.mode == "manual_baddbmm":
                qf = q.reshape(B * self.h, T, self.hd)
                kf = k.reshape(B * self.h, T, self.hd)
                base = torch.zeros(B * self.h, T, T, dtype=q.dtype)
                s = torch.baddbmm(base, qf, kf.transpose(1, 2), beta=0.0, alpha=scale).view(B, self.h, T, T)
            elif self.mode == "manual_einsum":
                s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
            else:
                s = q @ k.transpose(-1, -2) * scale
            if self.causal:
                if self.mask_kind == "masked_fill":
                    s = s.masked_fill(~causal, float("-inf"))
                elif self.mask_kind == "additive":
                    s = s + torch.zeros(T, T).masked_fill(~causal, torch.finfo(s.dtype).min)
                else:
                    s = torch.where(causal, s, torch.tensor(-1e9))
            if self.mode == "manual_dtype":
                a = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            else:
                a = s.softmax(-1)
            a = F.dropout(a, p=self.p, training=self.training)
            if self.mode == "manual_einsum":
                o = torch.einsum("bhqk,bhkd->bhqd", a, v)
            else:
                o = torch.matmul(a, v)
        o = o.transpose(1, 2).reshape(B, T, D)
        return self.o_proj(o)


class MixHeads(SelfAttention):
    """The same attention, in a class whose name does not say Attention."""


class MHABlock(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        heads = rng.choice([h for h in (1, 2, 4) if d % h == 0])
        self.mha = nn.MultiheadAttention(
            d, heads, dropout=rng.choice([0.0, 0.1]), batch_first=True, bias=rng.random() < 0.7
        )
        self.causal = rng.random() < 0.5
        self.need_weights = rng.random() < 0.3
        self.kpm = rng.random() < 0.3
        desc.append(f"nn.MHA:h{heads}:causal{int(self.causal)}:need_weights{int(self.need_weights)}:kpm{int(self.kpm)}")

    def forward(self, x):
        T = x.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).triu(1) if self.causal else None
        kpm = None
        if self.kpm:
            kpm = torch.zeros(x.shape[0], T, dtype=torch.bool)
            kpm[0, -1] = True
        o, w = self.mha(x, x, x, attn_mask=mask, need_weights=self.need_weights, key_padding_mask=kpm)
        if w is not None:
            o = o + w.mean() * 0.0 + w.sum(-1, keepdim=True)[..., :1].mean(1, keepdim=True) * 0.1
        return o


class TELayer(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        heads = rng.choice([h for h in (1, 2, 4) if d % h == 0])
        act = rng.choice(["relu", "gelu", "fn_gelu"])
        self.layer = nn.TransformerEncoderLayer(
            d,
            heads,
            dim_feedforward=2 * d,
            dropout=rng.choice([0.0, 0.1]),
            activation=F.gelu if act == "fn_gelu" else act,
            batch_first=True,
            norm_first=rng.random() < 0.5,
        )
        self.causal = rng.random() < 0.5
        desc.append(f"TransformerEncoderLayer:{act}:norm_first{int(self.layer.norm_first)}:causal{int(self.causal)}")

    def forward(self, x):
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T) if self.causal else None
        return self.layer(x, src_mask=mask, is_causal=self.causal)


# ----------------------------------------------------------------------------------------------- in-place / views etc.


class NormInplace(nn.Module):
    """norm output modified in place (tempo keeps the norm output)."""

    def __init__(self, d, rng, desc):
        super().__init__()
        self.norm, tag = make_norm(d, rng)
        self.op = rng.choice(
            [
                "iadd",
                "mul_",
                "masked_fill_",
                "view_iadd",
                "relu_",
                "then_linear",
                "clamp_",
                "div_",
                "index_put",
                "sub_slice",
            ]
        )
        self.lin = nn.Linear(d, d)
        desc.append(f"norm_inplace:{tag}:{self.op}")

    def forward(self, x):
        h = self.norm(x)
        if self.op == "iadd":
            h += x
        elif self.op == "mul_":
            h.mul_(2.0)
        elif self.op == "masked_fill_":
            m = torch.zeros_like(h, dtype=torch.bool)
            m[:, 0] = True
            h.masked_fill_(m, 0.0)
        elif self.op == "view_iadd":
            h[:, :1] += x[:, :1]
        elif self.op == "relu_":
            h.relu_()
        elif self.op == "then_linear":
            y = self.lin(h)
            return y + h
        elif self.op == "clamp_":
            h.clamp_(-1.0, 1.0)
        elif self.op == "div_":
            h /= 3.0
        elif self.op == "index_put":
            h[:, -1] = 0.0
        elif self.op == "sub_slice":
            h[..., :2].sub_(0.5)
        return self.lin(h)


class ActInplace(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.act, tag = make_act(rng)
        self.op = rng.choice(["mul_", "iadd", "add_x", "masked_fill_"])
        self.lin2 = nn.Linear(d, d)
        desc.append(f"act_inplace:{tag}:{self.op}")

    def forward(self, x):
        h = self.act(self.lin(x))
        if self.op == "mul_":
            h.mul_(2.0)
        elif self.op == "iadd":
            h += x
        elif self.op == "masked_fill_":
            h.masked_fill_(x > 1.0, 0.0)
        else:
            h = h + x
        return self.lin2(h)


class LinearInplace(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=rng.random() < 0.5)
        self.op = rng.choice(["iadd", "mul_", "masked_fill_", "tanh_"])
        desc.append(f"linear_inplace:{self.op}")

    def forward(self, x):
        h = self.lin(x)
        if self.op == "iadd":
            h += x
        elif self.op == "mul_":
            h.mul_(2.0)
        elif self.op == "masked_fill_":
            h.masked_fill_(x < -1.0, 0.0)
        else:
            h.tanh_()
        return h


class Residual(nn.Module):
    def __init__(self, inner, pre_norm=None):
        super().__init__()
        self.inner = inner
        self.norm = pre_norm

    def forward(self, x):
        h = self.norm(x) if self.norm is not None else x
        return x + self.inner(h)


class ChunkCat(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.a = nn.Linear(d // 2, d // 2)
        self.b = nn.Linear(d - d // 2, d - d // 2)
        desc.append("chunk_cat")

    def forward(self, x):
        left, right = x.split([x.shape[-1] // 2, x.shape[-1] - x.shape[-1] // 2], dim=-1)
        return torch.cat([self.a(left), F.gelu(self.b(right))], dim=-1)


class TransposeLinear(nn.Module):
    """Linear over the token axis (through transpose), non-contiguous input."""

    def __init__(self, d, rng, desc, T):
        super().__init__()
        self.lin = nn.Linear(T, T)
        desc.append("transpose_linear")

    def forward(self, x):
        return self.lin(x.transpose(1, 2)).transpose(1, 2)


class NoGradBranch(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.lin = nn.Linear(d, d)
        self.mode = rng.choice(["no_grad", "detach", "inference"])
        desc.append(f"nograd_branch:{self.mode}")

    def forward(self, x):
        if self.mode == "no_grad":
            with torch.no_grad():
                t = self.teacher(x)
            return self.lin(x) + t
        if self.mode == "inference":
            with torch.no_grad():
                t = self.teacher(x).clone()
            return self.lin(x) * t.sigmoid()
        return self.lin(x.detach()) + self.teacher(x)


class ConvBlock(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        k = rng.randrange(6)
        self.k = k
        if k == 0:
            self.conv = nn.Conv1d(d, d, 3, padding=1, bias=rng.random() < 0.5)
        elif k == 1:
            self.conv = nn.Conv1d(d, d, 3, padding=1, groups=d)  # depthwise
        elif k == 2:
            self.conv = nn.Conv2d(d, d, (3, 1), padding=(1, 0))
        elif k == 3:
            self.conv = nn.Conv1d(d, d, 3, padding=2, groups=d)  # causal conv, Mamba-like
        elif k == 4:
            self.conv = nn.Conv1d(d, d, 1)
            self.bn = nn.BatchNorm1d(d)
        else:
            self.conv = nn.Conv1d(d, d, 3, padding=1, groups=d)
            self.bn = nn.BatchNorm1d(d)
            self.act = nn.ReLU()
        desc.append(f"conv:{k}")

    def forward(self, x):
        T = x.shape[1]
        h = x.transpose(1, 2)
        if self.k == 2:
            return self.conv(h.unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        if self.k == 3:
            return self.conv(h)[..., :T].transpose(1, 2)
        h = self.conv(h)
        if self.k == 4:
            h = self.bn(h)
        if self.k == 5:
            h = self.act(self.bn(h))
        return h.transpose(1, 2)


class DropoutBlock(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.k = rng.randrange(4)
        p = rng.choice([0.1, 0.5])
        self.p = p
        self.drop = nn.Dropout(p, inplace=self.k == 2)
        desc.append(f"dropout:{self.k}:p{p}")

    def forward(self, x):
        if self.k == 0:
            return self.drop(self.lin(x))
        if self.k == 1:
            return F.dropout(self.lin(x), self.p, self.training)
        if self.k == 2:
            return self.drop(F.gelu(self.lin(x)))
        return self.lin(self.drop(x))


class SoftmaxBlock(nn.Module):
    """softmax outside attention, nn.Softmax module, matmul of activations."""

    def __init__(self, d, rng, desc):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.sm = nn.Softmax(dim=-1)
        self.k = rng.randrange(3)
        desc.append(f"softmax_block:{self.k}")

    def forward(self, x):
        if self.k == 0:
            return self.sm(self.lin(x)) * x
        if self.k == 1:
            g = self.lin(x)
            return torch.matmul(g.softmax(-1), g.transpose(-1, -2)) @ x
        return self.sm(self.lin(x) / 0.5) @ self.lin.weight


class LinearVariant(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        k = rng.randrange(10)
        bias = rng.random() < 0.5
        if k == 0:
            self.m, tag = nn.Linear(d, d, bias=bias), "Linear"
        elif k == 1:
            self.m, tag = ScaledLinear(d, d, bias), "ScaledLinear"
        elif k == 2:
            self.m, tag = LoRALinear(d, d, bias), "LoRALinear"
        elif k == 3:
            self.m, tag = TransformedWeightLinear(d, d, bias), "TransformedWeightLinear"
        elif k == 4:
            self.m, tag = ExtraParamUser(d, bias), "ExtraParamLinear"
        elif k == 5:
            self.m, tag = RenamedLinear(d, d, bias), "RenamedLinear"
        elif k == 6:
            self.m, tag = FLinearInCode(d, bias), "F.linear_in_code"
        elif k == 7:
            self.m, tag = SharedTwice(d, bias, rng.randrange(2)), "SharedTwice"
        elif k == 8:
            self.m, tag = TiedPair(d), "TiedPair"
        else:
            self.m, tag = make_parametrized_linear(d, bias, rng)
        desc.append("linear:" + tag)

    def forward(self, x):
        return self.m(x)


class NormBlock(nn.Module):
    def __init__(self, d, rng, desc):
        super().__init__()
        self.norm, tag = make_norm(d, rng)
        self.twice = rng.random() < 0.2
        desc.append("norm:" + tag + ("_twice" if self.twice else ""))

    def forward(self, x):
        h = self.norm(x)
        if self.twice:
            h = self.norm(h * 2.0 + 1.0)
        return h


class AdaLN(nn.Module):
    """norm(h) * (1 + scale) + shift, scale from a conditioning linear (DiT-like broadcast product)."""

    def __init__(self, d, rng, desc):
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.mod = nn.Linear(d, 2 * d)
        desc.append("adaln")

    def forward(self, x):
        c = x.mean(1)
        scale, shift = self.mod(F.silu(c)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class GatedProductInCode(nn.Module):
    """T5-style gated-gelu with act module object elsewhere + product in model code."""

    def __init__(self, d, rng, desc):
        super().__init__()
        self.wi_0 = nn.Linear(d, 2 * d, bias=False)
        self.wi_1 = nn.Linear(d, 2 * d, bias=False)
        self.wo = nn.Linear(2 * d, d, bias=False)
        self.act = NewGELU() if rng.random() < 0.5 else nn.GELU(approximate="tanh")
        self.reuse = rng.random() < 0.3
        desc.append(f"t5_gated:reuse{int(self.reuse)}")

    def forward(self, x):
        g = self.act(self.wi_0(x))
        u = self.wi_1(x)
        h = g * u
        if self.reuse:
            h = h + g  # the activation's output used again
        return self.wo(h)


class EdgeLeaf(nn.Module):
    """One of the hand-picked ``CASES`` at width ``d`` (those that run in plain PyTorch at any width)."""

    def __init__(self, d, rng, desc):
        super().__init__()
        _EDGE_WIDTH[0] = d
        names = [
            n
            for n in CASES
            if not n.startswith(
                (
                    "norm_ln_big_mean",
                    "probs_masked",
                    "probs_mul",
                    "probs_index",
                    "probs_dropout",
                    "act_relu_sq_then",
                    "act_gelu_then_input",
                    "act_product_",
                    "act_norm_broadcast_product_inplace",
                    "norm_ln_2d",
                    "norm_ln_module_2d",
                    "norm_ln_non_last",
                    "bmatmul_param_k",
                    "bmatmul_vec",
                    "ce_",
                )
            )
        ]
        if d % 2:
            names = [n for n in names if not n.startswith(("cross", "probs"))]
        name = rng.choice(names)
        self.inner = CASES[name]()
        desc.append("edge:" + name)

    def forward(self, x):
        out = self.inner(x)
        if out.shape != x.shape:
            out = out[..., : x.shape[-1]] if out.shape[:-1] == x.shape[:-1] else out.mean() + x
        return out


LEAF_BLOCKS = [
    ("edge", EdgeLeaf),
    ("edge", EdgeLeaf),
    ("linear", LinearVariant),
    ("norm", NormBlock),
    ("act", ActBlock),
    ("gated_mlp", GatedMLP),
    ("w123", W123MLP),
    ("swiglu", FusedSwiGLU),
    ("gated_dropout", GatedMLPDropout),
    ("plain_mlp", PlainMLP),
    ("attn", SelfAttention),
    ("mixheads", MixHeads),
    ("mha", MHABlock),
    ("te", TELayer),
    ("norm_inplace", NormInplace),
    ("act_inplace", ActInplace),
    ("linear_inplace", LinearInplace),
    ("chunk_cat", ChunkCat),
    ("nograd", NoGradBranch),
    ("conv", ConvBlock),
    ("dropout", DropoutBlock),
    ("softmax", SoftmaxBlock),
    ("adaln", AdaLN),
    ("t5_gated", GatedProductInCode),
]


class SeqList(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class DictBlocks(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})

    def forward(self, x):
        out = 0
        for b in self.blocks.values():
            out = out + b(x)
        return out


class PreNormBlock(nn.Module):
    """Llama/GPT-like block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, a, b, n1, n2):
        super().__init__()
        self.input_layernorm = n1
        self.self_attn = a
        self.post_attention_layernorm = n2
        self.mlp = b

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class PostNormBlock(nn.Module):
    """BERT-like: norm(x + f(x)), the norm's output then modified in place sometimes."""

    def __init__(self, inner, norm, inplace):
        super().__init__()
        self.inner = inner
        self.norm = norm
        self.inplace = inplace

    def forward(self, x):
        h = self.norm(x + self.inner(x))
        if self.inplace:
            h *= 1.5
        return h


def make_block(d, T, rng, desc, depth):
    r = rng.random()
    if depth > 0 and r < 0.35:
        kind = rng.randrange(6)
        n = rng.randint(1, 3)
        kids = [make_block(d, T, rng, desc, depth - 1) for _ in range(n)]
        if kind == 0:
            desc.append("Sequential")
            return nn.Sequential(*kids)
        if kind == 1:
            desc.append("ModuleList")
            return SeqList(kids)
        if kind == 2:
            desc.append("ModuleDict_sum")
            return DictBlocks(kids)
        if kind == 3:
            desc.append("Residual_prenorm")
            n, tag = make_norm(d, rng)
            desc.append("norm:" + tag)
            return Residual(nn.Sequential(*kids), n)
        if kind == 4:
            desc.append("PreNormBlock")
            n1, t1 = make_norm(d, rng)
            n2, t2 = make_norm(d, rng)
            desc += ["norm:" + t1, "norm:" + t2]
            a = rng.choice([SelfAttention, MixHeads])(d, rng, desc)
            b = rng.choice([GatedMLP, W123MLP, FusedSwiGLU, PlainMLP])(d, rng, desc)
            return PreNormBlock(a, b, n1, n2)
        desc.append("PostNormBlock")
        n, tag = make_norm(d, rng)
        desc.append("norm:" + tag)
        return PostNormBlock(nn.Sequential(*kids), n, rng.random() < 0.3)
    if rng.random() < 0.06:
        return TransposeLinear(d, rng, desc, T)
    if rng.random() < 0.05:
        desc.append("checkpoint")
        return Checkpointed(make_block(d, T, rng, desc, 0))
    _, cls = rng.choice(LEAF_BLOCKS)
    b = cls(d, rng, desc)
    if rng.random() < 0.3:
        desc.append("Residual")
        return Residual(b)
    return b


class Program(nn.Module):
    def __init__(self, d, T, rng, desc, vocab=None):
        super().__init__()
        self.vocab = vocab
        if vocab is not None:
            self.embed = nn.Embedding(vocab, d)
        self.body = make_block(d, T, rng, desc, rng.randint(1, 3))
        self.final_norm = None
        if rng.random() < 0.4:
            self.final_norm, tag = make_norm(d, rng)
            desc.append("final_norm:" + tag)
        if vocab is not None:
            self.lm_head = nn.Linear(d, vocab, bias=False)
            if rng.random() < 0.6:
                self.lm_head.weight = self.embed.weight
                desc.append("tied_lm_head")
            self.loss_kind = rng.choice(["ce", "ce_shift", "ce_ignore", "ce_smooth"])
            desc.append("lm_loss:" + self.loss_kind)

    def forward(self, x, targets=None):
        h = self.embed(x) if self.vocab is not None else x
        h = self.body(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        if self.vocab is None:
            return h
        logits = self.lm_head(h)
        if targets is None:
            return logits
        V = logits.shape[-1]
        if self.loss_kind == "ce":
            loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
        elif self.loss_kind == "ce_shift":
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), targets[:, 1:].reshape(-1))
        elif self.loss_kind == "ce_ignore":
            t = targets.clone()
            t[:, 0] = -100
            loss = F.cross_entropy(logits.view(-1, V), t.view(-1), ignore_index=-100)
        else:
            loss = F.cross_entropy(logits.view(-1, V), targets.view(-1), label_smoothing=0.1)
        return logits, loss


class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def build(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    d = rng.choice([8, 12, 16, 24, 32])
    T = rng.randint(3, 12)
    B = 2
    desc = [f"d{d}", f"T{T}"]
    vocab = rng.choice([None, None, None, 13])
    model = Program(d, T, rng, desc, vocab)
    xscale = rng.choice([1.0, 1.0, 3.0])
    fixed_T = any(e.startswith(("transpose_linear", "edge:bmatmul_param_k", "edge:norm_ln_2d")) for e in desc)
    T2 = T if fixed_T or rng.random() < 0.7 else rng.randint(3, 12)
    if T2 != T:
        desc.append(f"T2={T2}")
    use_labels = vocab is not None and rng.random() < 0.7
    if vocab is not None:
        desc.append(f"labels{int(use_labels)}")

    def make_input(step=1):
        t = T if step == 1 else T2
        g = torch.Generator().manual_seed(seed * 7 + t)
        if vocab is None:
            return (torch.randn(B, t, d, generator=g) * xscale).requires_grad_(True)
        return torch.randint(0, vocab, (B, t), generator=g)

    def loss_of(out):
        if isinstance(out, tuple):
            return out[1]
        g = torch.Generator().manual_seed(seed * 13 + out.numel())
        return (out * torch.randn(out.shape, generator=g)).sum()

    def call(model, inp):
        if use_labels:
            g = torch.Generator().manual_seed(seed * 17 + inp.shape[1])
            return model(inp, torch.randint(0, vocab, inp.shape, generator=g))
        return model(inp)

    return model, make_input, call, loss_of, desc


# ----------------------------------------------------------------------------------------------- edge cases
# Hand-picked cases a program's EdgeLeaf draws from, at the program's width.

_EDGE_T = 6
_EDGE_WIDTH = [16]


class _EdgeCase(nn.Module):
    """An edge case at the width :class:`EdgeLeaf` sets before building it."""

    def __init__(self):
        super().__init__()
        self.d = _EDGE_WIDTH[0]


class CrossAttention(_EdgeCase):
    """q from x (_EDGE_T tokens), k/v from a memory of S tokens, is_causal with _EDGE_T != S."""

    def __init__(self, S, mode):
        super().__init__()
        self.q = nn.Linear(self.d, self.d)
        self.k = nn.Linear(self.d, self.d)
        self.v = nn.Linear(self.d, self.d)
        self.S = S
        self.mode = mode
        self.mem = nn.Parameter(torch.randn(1, S, self.d))

    def forward(self, x):
        Bq = x.shape[0]
        m = self.mem.expand(Bq, -1, -1)
        q = self.q(x).view(Bq, -1, 2, self.d // 2).transpose(1, 2)
        k = self.k(m).view(Bq, -1, 2, self.d // 2).transpose(1, 2)
        v = self.v(m).view(Bq, -1, 2, self.d // 2).transpose(1, 2)
        if self.mode == "causal":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mode == "mask":
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(diagonal=k.shape[2] - q.shape[2])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(Bq, -1, self.d)


class SoftmaxDimAttention(_EdgeCase):
    def __init__(self, dim):
        super().__init__()
        self.q = nn.Linear(self.d, self.d)
        self.k = nn.Linear(self.d, self.d)
        self.v = nn.Linear(self.d, self.d)
        self.dim = dim

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        s = q @ k.transpose(-1, -2) / 4
        a = s.softmax(self.dim)
        return a @ v


class InplaceProbsAttention(_EdgeCase):
    def __init__(self, op):
        super().__init__()
        self.q = nn.Linear(self.d, self.d)
        self.k = nn.Linear(self.d, self.d)
        self.v = nn.Linear(self.d, self.d)
        self.op = op

    def forward(self, x):
        Bq, Tq, _ = x.shape
        q = self.q(x).view(Bq, Tq, 2, self.d // 2).transpose(1, 2)
        k = self.k(x).view(Bq, Tq, 2, self.d // 2).transpose(1, 2)
        v = self.v(x).view(Bq, Tq, 2, self.d // 2).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-1, -2) * 0.35, dim=-1)
        if self.op == "masked_fill_":
            pad = torch.zeros(Bq, 1, 1, Tq, dtype=torch.bool)
            pad[0, ..., -2:] = True
            a.masked_fill_(pad, 0.0)
        elif self.op == "mul_":
            a.mul_(2.0)
        elif self.op == "index":
            a[:, :, 0] = 0.0
        elif self.op == "dropout_inplace":
            a = F.dropout(a, 0.3, self.training, inplace=True)
        elif self.op == "renorm":
            a = a / a.sum(-1, keepdim=True)
        o = a @ v
        return o.transpose(1, 2).reshape(Bq, Tq, self.d)


class BroadcastMatmulAttention(_EdgeCase):
    def __init__(self, mode):
        super().__init__()
        self.q = nn.Linear(self.d, self.d)
        self.k = nn.Linear(self.d, self.d)
        self.v = nn.Linear(self.d, self.d)
        self.mode = mode
        self.kv = nn.Parameter(torch.randn(_EDGE_T, self.d))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.mode == "shared_k":  # k shared across the batch: [1, _EDGE_T, self.d]
            s = q @ k[:1].transpose(-1, -2)
        elif self.mode == "param_k":
            s = q @ self.kv.t()
        elif self.mode == "vec":
            s = q @ k.transpose(-1, -2)
            return (s.softmax(-1) @ v) + (q @ k[0, 0]).unsqueeze(-1)
        elif self.mode == "einsum_perm":
            s = torch.einsum("btd,bsd->bst", q, k)
        else:
            s = torch.bmm(q, k.transpose(1, 2))
        a = s.softmax(-1)
        return a @ v


class CEHead(_EdgeCase):
    def __init__(self, mode, V=11):
        super().__init__()
        self.lin = nn.Linear(self.d, self.d)
        self.head = nn.Linear(self.d, V)
        self.mode = mode
        self.V = V

    def forward(self, x):
        h = F.gelu(self.lin(x))
        logits = self.head(h)
        Bq, Tq, V = logits.shape
        g = torch.Generator().manual_seed(3)
        tg = torch.randint(0, V, (Bq, Tq), generator=g)
        m = self.mode
        if m == "classdim1":
            return F.cross_entropy(logits.transpose(1, 2), tg)
        if m == "sum":
            return F.cross_entropy(logits.reshape(-1, V), tg.reshape(-1), reduction="sum")
        if m == "none":
            each = F.cross_entropy(logits.reshape(-1, V), tg.reshape(-1), reduction="none")
            return (each * torch.arange(each.numel())).sum()
        if m == "weight":
            w = torch.rand(V, generator=g)
            return F.cross_entropy(logits.reshape(-1, V), tg.reshape(-1), weight=w)
        if m == "soft":
            p = torch.rand(Bq * Tq, V, generator=g).softmax(-1)
            return F.cross_entropy(logits.reshape(-1, V), p)
        if m == "smooth_ignore":
            t = tg.clone()
            t[0, :2] = -100
            return F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), label_smoothing=0.2)
        if m == "ignore_custom":
            t = tg.clone()
            t[0, :2] = 3
            return F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), ignore_index=3)
        if m == "zloss":
            ce = F.cross_entropy(logits.reshape(-1, V), tg.reshape(-1))
            return ce + 0.1 * torch.logsumexp(logits, -1).pow(2).mean()
        if m == "softcap":
            l2 = torch.tanh(logits / 3.0) * 3.0
            return F.cross_entropy(l2.reshape(-1, V), tg.reshape(-1))
        if m == "argmax_too":
            ce = F.cross_entropy(logits.reshape(-1, V), tg.reshape(-1))
            acc = (logits.argmax(-1) == tg).float().mean()
            return ce + acc
        if m == "logits_returned":
            ce = F.cross_entropy(logits.reshape(-1, V), tg.reshape(-1))
            return ce, logits
        if m == "two_ce":
            a = F.cross_entropy(logits.reshape(-1, V), tg.reshape(-1))
            b = F.cross_entropy(logits[:, 1:].reshape(-1, V), tg[:, :-1].reshape(-1))
            return a + 2 * b
        if m == "nll":
            return F.nll_loss(F.log_softmax(logits, -1).reshape(-1, V), tg.reshape(-1))
        if m == "ce_2d_pooled":
            pooled = self.head(h.mean(1))
            return F.cross_entropy(pooled, tg[:, 0])
        if m == "ce_float64":
            return F.cross_entropy(logits.double().reshape(-1, V), tg.reshape(-1))
        if m == "ce_mean_subset":
            sel = logits[:, -1]
            return F.cross_entropy(sel, tg[:, -1])
        raise ValueError(m)


class DropoutArgs(_EdgeCase):
    def __init__(self, mode):
        super().__init__()
        self.lin = nn.Linear(self.d, self.d)
        self.mode = mode

    def forward(self, x):
        h = self.lin(x)
        if self.mode == "training_false":
            return F.dropout(h, 0.5, training=False)
        if self.mode == "default_training":
            return F.dropout(h, 0.5)
        if self.mode == "dropout1d":
            return F.dropout1d(h, 0.5, self.training)
        if self.mode == "alpha":
            return F.alpha_dropout(h, 0.5, self.training)
        if self.mode == "p1":
            return F.dropout(h, 1.0, self.training)
        if self.mode == "torch_dropout":
            return torch.dropout(h, 0.3, self.training)
        if self.mode == "feature":
            return F.dropout2d(h.unsqueeze(-1), 0.5, self.training).squeeze(-1)
        raise ValueError


class ActArgs(_EdgeCase):
    def __init__(self, mode):
        super().__init__()
        self.lin = nn.Linear(self.d, self.d)
        self.lin2 = nn.Linear(self.d, self.d)
        self.mode = mode

    def forward(self, x):
        h = self.lin(x)
        m = self.mode
        if m == "silu_inplace":
            a = F.silu(h, inplace=True)
        elif m == "gelu_pos":
            a = F.gelu(h, approximate="tanh")
        elif m == "relu_sq_pow":
            a = F.relu(h) ** 2
        elif m == "relu_then_mul":
            r = F.relu(h)
            a = r * r
        elif m == "relu_sq_then_inplace":
            r = F.relu(h)
            a = r.square()
            r.mul_(2.0)
            a = a + r
        elif m == "gelu_reuse_input":
            a = F.gelu(h) + h
        elif m == "gelu_then_input_inplace":
            a = F.gelu(h)
            h.mul_(2.0)
            a = a + h
        elif m == "silu_out_inplace":
            a = F.silu(h)
            a.add_(1.0)
        elif m == "product_then_inplace":
            g = F.silu(h)
            u = self.lin2(x)
            a = g * u
            g.mul_(3.0)
            a = a + g
        elif m == "product_factor_inplace":
            g = F.silu(h)
            u = self.lin2(x)
            a = g * u
            u.mul_(3.0)
            a = a + u
        elif m == "relu_torch":
            a = torch.relu(h)
        elif m == "relu_method":
            a = h.relu()
        elif m == "gelu_half_view":
            a = F.gelu(h[..., : self.d // 2])
            a = torch.cat([a, h[..., self.d // 2 :]], -1)
        elif m == "silu_tensor_method":
            a = torch.nn.functional.silu(h.t() if h.dim() == 2 else h.transpose(0, 1)).transpose(0, 1)
        elif m == "relu6":
            a = F.relu6(h)
        elif m == "hardtanh":
            a = F.hardtanh(h)
        elif m == "leaky":
            a = F.leaky_relu(h, 0.2)
        elif m == "threshold":
            a = F.threshold(h, 0.1, -1.0)
        elif m == "relu_mul_broadcast":
            a = F.relu(h) * self.lin2.bias
        elif m == "norm_product":
            a = F.layer_norm(h, (self.d,)) * self.lin2(x)  # same-shape product with norm output
        elif m == "norm_broadcast_product":
            a = F.layer_norm(h, (self.d,)) * (1 + self.lin2(x).mean(1, keepdim=True))
        elif m == "norm_broadcast_product_inplace":
            n = F.layer_norm(h, (self.d,))
            s = 1 + self.lin2(x).mean(1, keepdim=True)
            a = n * s
            s.mul_(2.0)
            a = a + s
        else:
            raise ValueError(m)
        return self.lin2(a)


class NormArgs(_EdgeCase):
    def __init__(self, mode):
        super().__init__()
        self.lin = nn.Linear(self.d, self.d)
        self.mode = mode
        self.w = nn.Parameter(1 + 0.3 * torch.randn(self.d))
        self.b = nn.Parameter(0.3 * torch.randn(self.d))
        self.w2 = nn.Parameter(1 + 0.3 * torch.randn(_EDGE_T, self.d))
        self.ln2 = nn.LayerNorm([_EDGE_T, self.d])
        with torch.no_grad():
            self.ln2.weight.add_(0.3 * torch.randn(_EDGE_T, self.d))

    def forward(self, x):
        h = self.lin(x)
        m = self.mode
        if m == "ln_2d":
            return F.layer_norm(h, (h.shape[1], self.d), self.w2, None)
        if m == "ln_module_2d":
            return self.ln2(h)
        if m == "ln_eps_big":
            return F.layer_norm(h, (self.d,), self.w, self.b, eps=1.0)
        if m == "rms_no_eps":
            return F.rms_norm(h, (self.d,), self.w)
        if m == "rms_eps_big":
            return F.rms_norm(h, (self.d,), self.w, eps=0.5)
        if m == "ln_non_last":
            return F.layer_norm(h.transpose(1, 2), (_EDGE_T,)).transpose(1, 2)
        if m == "ln_weight_view":
            return F.layer_norm(h, (self.d,), self.w2[0], self.b)
        if m == "ln_weight_expr":
            return F.layer_norm(h, (self.d,), self.w * 2, self.b + 1)
        if m == "ln_const_row":
            h2 = h.clone()
            h2[0, 0] = 5.0
            return F.layer_norm(h2, (self.d,), self.w, self.b)
        if m == "ln_big_mean":
            return F.layer_norm(h + 1000.0, (self.d,), self.w, self.b)
        if m == "ln_out_reused":
            y = F.layer_norm(h, (self.d,), self.w, self.b)
            return y * y.detach() + self.lin(y)
        if m == "group_norm":
            return F.group_norm(h.transpose(1, 2), 4, self.w, self.b).transpose(1, 2)
        if m == "ln_then_view_inplace":
            y = F.layer_norm(h, (self.d,), self.w, self.b)
            v = y.view(-1, self.d)
            v.mul_(2.0)
            return y
        if m == "ln_small_weight":
            return F.layer_norm(h, (self.d,), self.w * 1e-3, self.b * 1e-3 * 16)
        raise ValueError(m)


CASES = {}
for S in (3, 9):
    for mode in ("causal", "mask", "none"):
        CASES[f"cross_attn_S{S}_{mode}"] = lambda S=S, mode=mode: CrossAttention(S, mode)
for dim in (-1, -2, 1):
    CASES[f"softmax_dim{dim}"] = lambda dim=dim: SoftmaxDimAttention(dim)
for op in ("masked_fill_", "mul_", "index", "dropout_inplace", "renorm"):
    CASES[f"probs_{op}"] = lambda op=op: InplaceProbsAttention(op)
for mode in ("shared_k", "param_k", "vec", "einsum_perm", "bmm"):
    CASES[f"bmatmul_{mode}"] = lambda mode=mode: BroadcastMatmulAttention(mode)
for mode in (
    "classdim1",
    "sum",
    "none",
    "weight",
    "soft",
    "smooth_ignore",
    "ignore_custom",
    "zloss",
    "softcap",
    "argmax_too",
    "logits_returned",
    "two_ce",
    "nll",
    "ce_2d_pooled",
    "ce_float64",
    "ce_mean_subset",
):
    CASES[f"ce_{mode}"] = lambda mode=mode: CEHead(mode)
for mode in ("training_false", "default_training", "dropout1d", "alpha", "p1", "torch_dropout", "feature"):
    CASES[f"drop_{mode}"] = lambda mode=mode: DropoutArgs(mode)
for mode in (
    "silu_inplace",
    "gelu_pos",
    "relu_sq_pow",
    "relu_then_mul",
    "relu_sq_then_inplace",
    "gelu_reuse_input",
    "gelu_then_input_inplace",
    "silu_out_inplace",
    "product_then_inplace",
    "product_factor_inplace",
    "relu_torch",
    "relu_method",
    "gelu_half_view",
    "silu_tensor_method",
    "relu6",
    "hardtanh",
    "leaky",
    "threshold",
    "relu_mul_broadcast",
    "norm_product",
    "norm_broadcast_product",
    "norm_broadcast_product_inplace",
):
    CASES[f"act_{mode}"] = lambda mode=mode: ActArgs(mode)
for mode in (
    "ln_2d",
    "ln_module_2d",
    "ln_eps_big",
    "rms_no_eps",
    "rms_eps_big",
    "ln_non_last",
    "ln_weight_view",
    "ln_weight_expr",
    "ln_const_row",
    "ln_big_mean",
    "ln_out_reused",
    "group_norm",
    "ln_then_view_inplace",
    "ln_small_weight",
):
    CASES[f"norm_{mode}"] = lambda mode=mode: NormArgs(mode)


class SubEval(_EdgeCase):
    """A submodule put in eval mode while the model trains (frozen BatchNorm, disabled dropout)."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(self.d, self.d)
        if mode.startswith("bn"):
            self.bn = nn.BatchNorm1d(
                self.d,
                momentum=None if mode == "bn_cumavg" else 0.1,
                track_running_stats=mode != "bn_notrack",
                affine=mode != "bn_noaffine",
            )
            if self.bn.running_mean is not None:
                self.bn.running_mean.normal_()
                self.bn.running_var.uniform_(0.5, 2.0)
        else:
            self.drop = nn.Dropout(0.5)
        self.act = nn.GELU()

    def forward(self, x):
        if self.mode == "bn_eval":
            self.bn.eval()
        if self.mode == "drop_eval":
            self.drop.eval()
        h = self.lin(x)
        if self.mode.startswith("bn"):
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        else:
            h = self.drop(h)
        return self.act(h)


class ConvVariants(_EdgeCase):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        if mode == "reflect":
            self.c = nn.Conv1d(self.d, self.d, 3, padding=1, padding_mode="reflect")
        elif mode == "circular":
            self.c = nn.Conv1d(self.d, self.d, 3, padding=1, padding_mode="circular")
        elif mode == "dilated":
            self.c = nn.Conv1d(self.d, self.d, 3, padding=2, dilation=2)
        elif mode == "same":
            self.c = nn.Conv1d(self.d, self.d, 4, padding="same")
        elif mode == "strided":
            self.c = nn.Conv1d(self.d, self.d, 2, stride=2)
        elif mode == "grouped":
            self.c = nn.Conv1d(self.d, self.d, 3, padding=1, groups=2)
        elif mode == "conv2d_cl":
            self.c = nn.Conv2d(self.d, self.d, 3, padding=1)
        elif mode == "convT":
            self.c = nn.ConvTranspose1d(self.d, self.d, 3, padding=1)
        elif mode == "hf_conv1d":
            from transformers.pytorch_utils import Conv1D

            self.c = Conv1D(self.d, self.d)

    def forward(self, x):
        if self.mode == "hf_conv1d":
            return self.c(x)
        if self.mode == "conv2d_cl":
            h = x.transpose(1, 2).unsqueeze(-1).expand(-1, -1, -1, 3).contiguous(memory_format=torch.channels_last)
            return self.c(h).mean(-1).transpose(1, 2)
        y = self.c(x.transpose(1, 2))
        if self.mode == "strided":
            y = y.repeat_interleave(2, -1)[..., : x.shape[1]]
            if y.shape[-1] < x.shape[1]:
                y = F.pad(y, (0, x.shape[1] - y.shape[-1]))
        return y.transpose(1, 2)


class NoncontigWeight(_EdgeCase):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(self.d, self.d)
        self.lin.weight = nn.Parameter(torch.randn(self.d, self.d).t())  # a transposed (non-contiguous) parameter
        self.lin2 = nn.Linear(self.d, 2 * self.d)
        self.lin2.weight = nn.Parameter(torch.randn(self.d, 4 * self.d)[:, ::2].t())  # strided

    def forward(self, x):
        return self.lin(x) + self.lin2(x)[..., : self.d]


for mode in ("bn_eval", "bn_cumavg", "bn_notrack", "bn_noaffine", "drop_eval"):
    CASES[f"subeval_{mode}"] = lambda mode=mode: SubEval(mode)
for mode in ("reflect", "circular", "dilated", "same", "strided", "grouped", "conv2d_cl", "convT", "hf_conv1d"):
    CASES[f"conv_{mode}"] = lambda mode=mode: ConvVariants(mode)
CASES["noncontig_weight"] = lambda: NoncontigWeight("x")
