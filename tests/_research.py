"""Research-code patterns at test size, transcribed with their op sequence as written in the wild (``einops``
rearranges written with torch ops, a comment giving the einops spelling):

* lucidrains' attention (x-transformers, vit-pytorch): ``to_qkv`` chunked, heads split, ``einsum`` scores, a causal
  ``masked_fill`` with ``-finfo.max``, softmax, dropout, ``einsum`` with v; rotary embeddings; pre/post-softmax
  talking heads (``einsum('b h i j, h k -> b k i j')``); ``qk_norm`` (``F.normalize``, a learned temperature);
  ``PreNorm``; GELU ``FeedForward``.
* MLP-Mixer: token mixing over the transposed LayerNorm output (timm/Google), or a kernel-1 ``Conv1d``
  (lucidrains' ``mlp-mixer-pytorch``).
* Perceiver (lucidrains' ``perceiver-pytorch``): learned latents expanded over the batch cross-attend to the data,
  ``(b h) n d`` heads, a GEGLU feed-forward.
* A hand-written top-k MoE of gated SiLU experts (``index_select`` / ``torch.where`` masks, ``index_add_``).
* mamba-minimal (johnma2006): a Python-loop selective scan, a hand-written RMSNorm.
* RWKV-4: token shift by ``nn.ZeroPad2d((0, 0, 1, -1))``, a Python-loop WKV, squared-ReLU channel mix,
  ``sigmoid(r) * kv``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# --- lucidrains' attention --------------------------------------------------------------------------------------


def _split_heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """``rearrange(t, 'b n (h d) -> b h n d', h=h)``."""
    b, n, _ = t.shape
    return t.reshape(b, n, h, -1).permute(0, 2, 1, 3)


def _merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``rearrange(t, 'b h n d -> b n (h d)')``."""
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """rotary-embedding-torch's: ``rearrange(x, '... (d r) -> ... d r', r=2)``, ``(-x2, x1)``, back."""
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.reshape(*x.shape[:-2], -1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, n: int) -> torch.Tensor:
        t = torch.arange(n, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        return freqs.repeat_interleave(2, dim=-1)  # repeat(freqs, '... n -> ... (n r)', r=2)


def apply_rotary_emb(freqs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t * freqs.cos() + rotate_half(t) * freqs.sin()


class PreNorm(nn.Module):
    def __init__(self, dim: int, fn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden_dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    """x-transformers' attention: ``causal``, ``talking_heads`` (pre- and post-softmax head mixing), ``qk_norm``
    (l2-normalised q, k and a learned per-head temperature in place of ``dim_head ** -0.5``), ``rotary``,
    ``save_attn`` (the attention map and its gradient kept for attribution, as vit-pytorch's explainability fork)."""

    def __init__(self, dim: int, heads: int = 4, dim_head: int = 16, dropout: float = 0.0, causal: bool = False,
                 talking_heads: bool = False, qk_norm: bool = False, rotary: bool = False,
                 save_attn: bool = False) -> None:
        super().__init__()
        inner_dim = dim_head * heads
        self.heads, self.causal, self.talking_heads, self.qk_norm = heads, causal, talking_heads, qk_norm
        self.save_attn = save_attn
        self.scale = dim_head**-0.5
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.dropout = nn.Dropout(dropout)
        if talking_heads:
            self.pre_softmax_proj = nn.Parameter(torch.randn(heads, heads))
            self.post_softmax_proj = nn.Parameter(torch.randn(heads, heads))
        if qk_norm:
            self.qk_norm_scale = nn.Parameter(torch.full((1, heads, 1, 1), math.log(10.0)))
        self.rotary = RotaryEmbedding(dim_head) if rotary else None
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (_split_heads(t, self.heads) for t in qkv)
        if self.rotary is not None:
            freqs = self.rotary(q.shape[-2])
            q, k = apply_rotary_emb(freqs, q), apply_rotary_emb(freqs, k)
        scale = self.scale
        if self.qk_norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            scale = self.qk_norm_scale.exp()
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        if self.talking_heads:
            dots = torch.einsum("b h i j, h k -> b k i j", dots, self.pre_softmax_proj)
        if self.causal:
            i, j = dots.shape[-2:]
            mask = torch.ones(i, j, dtype=torch.bool).triu(j - i + 1)
            dots = dots.masked_fill(mask, -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        if self.save_attn:  # vit-pytorch's explainability fork (Chefer et al.): the map and its gradient, by a hook
            self.attn = attn
            attn.register_hook(self.save_attn_gradients)
        attn = self.dropout(attn)
        if self.talking_heads:
            attn = torch.einsum("b h i j, h k -> b k i j", attn, self.post_softmax_proj)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(_merge_heads(out))

    def save_attn_gradients(self, grad: torch.Tensor) -> None:
        self.attn_gradients = grad


class Transformer(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2, heads: int = 4, dim_head: int = 16, mlp_dim: int = 64,
                 dropout: float = 0.0, **attn) -> None:
        super().__init__()
        self.layers = nn.ModuleList([
            nn.ModuleList([PreNorm(dim, Attention(dim, heads, dim_head, dropout, **attn)),
                           PreNorm(dim, FeedForward(dim, mlp_dim, dropout))])
            for _ in range(depth)
        ])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm(x)


class TinyLM(nn.Module):
    """A decoder of the above (x-transformers' ``TransformerWrapper``): embedding, blocks, logits."""

    def __init__(self, vocab: int = 50, dim: int = 32, **kw) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(vocab, dim)
        self.transformer = Transformer(dim, **kw)
        self.to_logits = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.to_logits(self.transformer(self.token_emb(x)))


class XAttention(nn.Module):
    """x-transformers' ``Attention`` with more of its options on: learned memory key/values (``num_mem_kv``,
    expanded over the batch and concatenated), an ALiBi bias, a key padding mask, the max-subtracted softmax in fp32
    (``sim - sim.amax(-1, keepdim=True).detach()``, ``softmax(dtype=torch.float32)``), a 1x1 ``Conv2d`` for
    pre-softmax talking heads, a sigmoid output gate, and cross-attention to a context."""

    def __init__(self, dim: int = 32, heads: int = 4, dim_head: int = 16, num_mem_kv: int = 2, dropout: float = 0.1,
                 talking_heads: bool = True, gate: bool = True) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head**-0.5
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.mem_k = nn.Parameter(torch.randn(heads, num_mem_kv, dim_head))
        self.mem_v = nn.Parameter(torch.randn(heads, num_mem_kv, dim_head))
        self.pre_softmax_talking_heads = nn.Conv2d(heads, heads, 1, bias=False) if talking_heads else None
        self.to_v_gate = nn.Linear(dim, inner) if gate else None
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner, dim)
        slopes = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)])
        self.register_buffer("slopes", slopes.view(heads, 1, 1), persistent=False)

    def forward(self, x, context=None, mask=None):
        b = x.shape[0]
        kv_input = x if context is None else context
        q = _split_heads(self.to_q(x), self.heads)
        k, v = (_split_heads(t, self.heads) for t in self.to_kv(kv_input).chunk(2, dim=-1))
        k = torch.cat((self.mem_k.expand(b, -1, -1, -1), k), dim=-2)  # repeat(mem_k, 'h n d -> b h n d', b=b)
        v = torch.cat((self.mem_v.expand(b, -1, -1, -1), v), dim=-2)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = sim.shape[-2:]
        sim = sim - self.slopes * (torch.arange(j) - torch.arange(i)[:, None] - (j - i)).abs()
        if self.pre_softmax_talking_heads is not None:
            sim = self.pre_softmax_talking_heads(sim)
        if mask is not None:
            mask = F.pad(mask, (self.mem_k.shape[-2], 0), value=True)
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1, dtype=torch.float32).to(sim.dtype)
        attn = self.dropout(attn)
        out = _merge_heads(torch.einsum("b h i j, b h j d -> b h i d", attn, v))
        if self.to_v_gate is not None:
            out = out * self.to_v_gate(x).sigmoid()
        return self.to_out(out)


class XBlock(nn.Module):
    """Self-attention over a padded batch, cross-attention to a context, a GELU feed-forward; pre-norm."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = XAttention(dim)
        self.cross_attn = XAttention(dim, talking_heads=False, gate=False)
        self.ff = FeedForward(dim, 2 * dim)

    def forward(self, x, context, mask):
        x = x + self.self_attn(self.norm1(x), mask=mask)
        x = x + self.cross_attn(self.norm2(x), context=context)
        return x + self.ff(self.norm3(x))


# --- MLP-Mixer -------------------------------------------------------------------------------------------------


class MixerBlock(nn.Module):
    """timm's ``MixerBlock``: ``x + mlp_tokens(norm1(x).transpose(1, 2)).transpose(1, 2)``, then the channel MLP."""

    def __init__(self, dim: int, seq_len: int, mlp_ratio=(0.5, 4.0)) -> None:
        super().__init__()
        tokens_dim, channels_dim = int(mlp_ratio[0] * dim), int(mlp_ratio[1] * dim)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp_tokens = nn.Sequential(nn.Linear(seq_len, tokens_dim), nn.GELU(), nn.Linear(tokens_dim, seq_len))
        self.norm2 = nn.LayerNorm(dim)
        self.mlp_channels = nn.Sequential(nn.Linear(dim, channels_dim), nn.GELU(), nn.Linear(channels_dim, dim))

    def forward(self, x):
        x = x + self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp_channels(self.norm2(x))


class PreNormResidual(nn.Module):
    def __init__(self, dim: int, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.fn(self.norm(x)) + x


def _mixer_ff(dim: int, expansion: float, dense) -> nn.Sequential:
    inner = int(dim * expansion)
    return nn.Sequential(dense(dim, inner), nn.GELU(), nn.Dropout(0.0), dense(inner, dim), nn.Dropout(0.0))


class Patches(nn.Module):
    """``Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)', p1=p, p2=p)``."""

    def __init__(self, p: int) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        b, c, hh, ww = x.shape
        p = self.p
        x = x.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (hh // p) * (ww // p), p * p * c)


class MeanTokens(nn.Module):
    """``Reduce('b n c -> b c', 'mean')``."""

    def forward(self, x):
        return x.mean(dim=1)


def MLPMixer(image_size: int = 16, channels: int = 3, patch_size: int = 4, dim: int = 32, depth: int = 2,
             num_classes: int = 10, conv_tokens: bool = False) -> nn.Module:
    """lucidrains' ``MLPMixer`` (``conv_tokens``: its kernel-1 ``Conv1d`` token mixing) or one of timm's blocks."""
    n = (image_size // patch_size) ** 2
    if conv_tokens:
        blocks = [nn.Sequential(PreNormResidual(dim, _mixer_ff(n, 4, lambda i, o: nn.Conv1d(i, o, kernel_size=1))),
                                PreNormResidual(dim, _mixer_ff(dim, 0.5, nn.Linear))) for _ in range(depth)]
    else:
        blocks = [MixerBlock(dim, n) for _ in range(depth)]
    return nn.Sequential(Patches(patch_size), nn.Linear(patch_size**2 * channels, dim), *blocks, nn.LayerNorm(dim),
                         MeanTokens(), nn.Linear(dim, num_classes))


# --- Perceiver --------------------------------------------------------------------------------------------------


class PerceiverAttention(nn.Module):
    """perceiver-pytorch's ``Attention`` (heads folded into the batch: ``(b h) n d``)."""

    def __init__(self, query_dim: int, context_dim: int | None = None, heads: int = 2, dim_head: int = 16,
                 dropout: float = 0.0) -> None:
        super().__init__()
        inner = dim_head * heads
        context_dim = context_dim or query_dim
        self.scale, self.heads = dim_head**-0.5, heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(context_dim, inner * 2, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context=None):
        h = self.heads
        q = self.to_q(x)
        context = x if context is None else context
        k, v = self.to_kv(context).chunk(2, dim=-1)

        def fold(t):  # rearrange(t, 'b n (h d) -> (b h) n d', h=h)
            b, n, _ = t.shape
            return t.reshape(b, n, h, -1).permute(0, 2, 1, 3).reshape(b * h, n, -1)

        q, k, v = fold(q), fold(k), fold(v)
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        out = torch.einsum("b i j, b j d -> b i d", attn, v)
        bh, n, d = out.shape  # rearrange(out, '(b h) n d -> b n (h d)', h=h)
        out = out.reshape(bh // h, h, n, d).permute(0, 2, 1, 3).reshape(bh // h, n, h * d)
        return self.to_out(out)


class PerceiverPreNorm(nn.Module):
    def __init__(self, dim: int, fn: nn.Module, context_dim: int | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(context_dim) if context_dim is not None else None

    def forward(self, x, **kwargs):
        x = self.norm(x)
        if self.norm_context is not None:
            kwargs.update(context=self.norm_context(kwargs["context"]))
        return self.fn(x, **kwargs)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class PerceiverFeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult * 2), GEGLU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Perceiver(nn.Module):
    def __init__(self, input_dim: int = 24, num_latents: int = 8, latent_dim: int = 32, depth: int = 1,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim))
        self.cross_attn = PerceiverPreNorm(latent_dim, PerceiverAttention(latent_dim, input_dim), context_dim=input_dim)
        self.cross_ff = PerceiverPreNorm(latent_dim, PerceiverFeedForward(latent_dim))
        self.layers = nn.ModuleList([
            nn.ModuleList([PerceiverPreNorm(latent_dim, PerceiverAttention(latent_dim)),
                           PerceiverPreNorm(latent_dim, PerceiverFeedForward(latent_dim))])
            for _ in range(depth)
        ])
        self.to_logits = nn.Sequential(nn.LayerNorm(latent_dim), nn.Linear(latent_dim, num_classes))

    def forward(self, data):
        b = data.shape[0]
        x = self.latents.expand(b, -1, -1)  # repeat(self.latents, 'n d -> b n d', b=b)
        x = self.cross_attn(x, context=data) + x
        x = self.cross_ff(x) + x
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.to_logits(x.mean(dim=-2))


# --- top-k MoE ----------------------------------------------------------------------------------------------------


class Expert(nn.Module):
    """A gated SiLU MLP in Meta's names."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routing by hand: router, softmax, topk, renormalised weights; per expert the tokens that chose it
    (``index_select`` with ``torch.where`` of ``idx == e``, or Mixtral's one-hot mask and ``x[None, top_x]``), the
    weighted expert output added back with ``index_add_``."""

    def __init__(self, dim: int = 32, hidden: int = 48, num_experts: int = 4, k: int = 2, mixtral: bool = False):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(dim, hidden) for _ in range(num_experts)])
        self.k, self.mixtral = k, mixtral

    def forward(self, x):
        b, t, d = x.shape
        x_flat = x.view(-1, d)
        probs = F.softmax(self.gate(x_flat), dim=-1)
        weights, idx = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x_flat)
        if self.mixtral:
            expert_mask = F.one_hot(idx, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            if self.mixtral:
                slot, top_x = torch.where(expert_mask[e])
                current = x_flat[None, top_x].reshape(-1, d)
                y = expert(current) * weights[top_x, slot, None]
                out.index_add_(0, top_x, y.to(x.dtype))
            else:
                token_idx, slot = torch.where(idx == e)
                if token_idx.numel() == 0:
                    continue
                y = expert(x_flat.index_select(0, token_idx)) * weights[token_idx, slot].unsqueeze(-1)
                out.index_add_(0, token_idx, y)
        return out.view(b, t, d)


class MoEBlock(nn.Module):
    def __init__(self, dim: int = 32, **kw) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, causal=True)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, **kw)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


# --- mamba-minimal -----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MambaBlock(nn.Module):
    def __init__(self, d_model: int = 32, d_state: int = 8, expand: int = 2, d_conv: int = 4) -> None:
        super().__init__()
        self.d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16)
        self.d_state = d_state
        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=True)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + d_state * 2, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        a = torch.arange(1, d_state + 1).float().repeat(self.d_inner, 1)  # repeat(arange, 'n -> d n', d=d_inner)
        self.A_log = nn.Parameter(torch.log(a))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, x):
        _, seq_len, _ = x.shape  # (b, l, d)
        x_and_res = self.in_proj(x)
        x, res = x_and_res.split(split_size=[self.d_inner, self.d_inner], dim=-1)
        x = x.transpose(1, 2)  # rearrange(x, 'b l d_in -> b d_in l')
        x = self.conv1d(x)[:, :, :seq_len]
        x = x.transpose(1, 2)
        x = F.silu(x)
        y = self.ssm(x)
        y = y * F.silu(res)
        return self.out_proj(y)

    def ssm(self, x):
        n = self.A_log.shape[1]
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        x_dbl = self.x_proj(x)
        delta, B, C = x_dbl.split(split_size=[self.dt_rank, n, n], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        return self.selective_scan(x, delta, A, B, C, D)

    def selective_scan(self, u, delta, A, B, C, D):
        b, seq_len, d_in = u.shape
        n = A.shape[1]
        deltaA = torch.exp(torch.einsum("bld,dn->bldn", delta, A))
        deltaB_u = torch.einsum("bld,bln,bld->bldn", delta, B, u)
        x = torch.zeros((b, d_in, n), device=deltaA.device)
        ys = []
        for i in range(seq_len):
            x = deltaA[:, i] * x + deltaB_u[:, i]
            y = torch.einsum("bdn,bn->bd", x, C[:, i, :])
            ys.append(y)
        y = torch.stack(ys, dim=1)
        return y + u * D


class ResidualBlock(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.mixer = MambaBlock(d_model)
        self.norm = RMSNorm(d_model)

    def forward(self, x):
        return self.mixer(self.norm(x)) + x


class Mamba(nn.Module):
    def __init__(self, vocab_size: int = 50, d_model: int = 32, n_layer: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList([ResidualBlock(d_model) for _ in range(n_layer)])
        self.norm_f = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight  # tied

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


# --- RWKV-4 -------------------------------------------------------------------------------------------------------


def _wkv(time_decay, time_first, k, v):
    """RWKV-4's WKV as its CPU reference writes it (numerically stable running max); ``[B, T, C]``."""
    w, u = -torch.exp(time_decay), time_first
    aa = torch.zeros_like(k[:, 0])
    bb = torch.zeros_like(k[:, 0])
    pp = torch.full_like(k[:, 0], -1e38)
    out = []
    for t in range(k.shape[1]):
        kk, vv = k[:, t], v[:, t]
        ww = u + kk
        p = torch.maximum(pp, ww)
        e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
        out.append((e1 * aa + e2 * vv) / (e1 * bb + e2))
        ww = w + pp
        p = torch.maximum(ww, kk)
        e1, e2 = torch.exp(ww - p), torch.exp(kk - p)
        aa, bb, pp = e1 * aa + e2 * vv, e1 * bb + e2, p
    return torch.stack(out, dim=1)


class RWKV_TimeMix(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.time_decay = nn.Parameter(torch.linspace(-1.0, 1.0, n_embd))
        self.time_first = nn.Parameter(torch.full((n_embd,), math.log(0.3)))
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        ramp = torch.arange(n_embd) / n_embd
        self.time_mix_k = nn.Parameter(ramp.clone().view(1, 1, n_embd))
        self.time_mix_v = nn.Parameter((ramp + 0.1).view(1, 1, n_embd))
        self.time_mix_r = nn.Parameter((0.5 * ramp).view(1, 1, n_embd))
        self.key = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(n_embd, n_embd, bias=False)
        self.receptance = nn.Linear(n_embd, n_embd, bias=False)
        self.output = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xv = x * self.time_mix_v + xx * (1 - self.time_mix_v)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k, v, r = self.key(xk), self.value(xv), self.receptance(xr)
        sr = torch.sigmoid(r)
        return self.output(sr * _wkv(self.time_decay, self.time_first, k, v))


class RWKV_ChannelMix(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        ramp = torch.arange(n_embd) / n_embd
        self.time_mix_k = nn.Parameter(ramp.clone().view(1, 1, n_embd))
        self.time_mix_r = nn.Parameter((0.5 * ramp).view(1, 1, n_embd))
        self.key = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.receptance = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = self.key(xk)
        k = torch.square(torch.relu(k))
        kv = self.value(k)
        return torch.sigmoid(self.receptance(xr)) * kv


class RWKVBlock(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.att = RWKV_TimeMix(n_embd)
        self.ffn = RWKV_ChannelMix(n_embd)

    def forward(self, x):
        x = x + self.att(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class RWKV(nn.Module):
    def __init__(self, vocab: int = 50, n_embd: int = 32, n_layer: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, n_embd)
        self.ln0 = nn.LayerNorm(n_embd)
        self.blocks = nn.Sequential(*[RWKVBlock(n_embd) for _ in range(n_layer)])
        self.ln_out = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.ln_out(self.blocks(self.ln0(self.emb(idx)))))
