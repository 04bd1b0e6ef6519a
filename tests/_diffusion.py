"""Tiny diffusion models transcribed from their sources (``diffusers`` and ``timm`` are not installed here).

Each class keeps the op sequence and module structure of the code it is named after, so that what slimact
recognises, converts and routes is what it would meet in the real model:

* diffusers (``models/resnet.py``, ``models/attention.py``, ``models/attention_processor.py``,
  ``models/embeddings.py``, ``models/transformers/transformer_2d.py``, ``models/unets/unet_2d_blocks.py``):
  :class:`ResnetBlock2D`, :class:`Downsample2D`, :class:`Upsample2D`, :class:`Attention` with
  :class:`AttnProcessor2_0` (``F.scaled_dot_product_attention``) or the older :class:`AttnProcessor`
  (``torch.baddbmm`` on an uninitialised ``torch.empty`` with ``beta=0``, softmax, ``torch.bmm``),
  :class:`FeedForward` with :class:`GEGLU`, :class:`BasicTransformerBlock`, :class:`Transformer2DModel`,
  :class:`Timesteps`/:class:`TimestepEmbedding`, a two-level :class:`TinyUNet2DCondition` in the shape of
  ``UNet2DConditionModel`` (cross-attention down/up blocks with skip connections, a cross-attention mid block),
  and the VAE's :class:`UNetMidBlock2D` (attention over the ``H * W`` positions, a GroupNorm before it).
* facebookresearch/DiT ``models.py`` with timm's ``PatchEmbed``, ``Attention`` and ``Mlp``: :class:`DiT`
  (adaLN-Zero blocks, zero-initialised modulation and final layer, as ``initialize_weights`` leaves them).

Left out: what a tiny training step does not reach (attention masks, LoRA scales, npu/mps branches, the
``up``/``down`` resampling inside a ResNet block, FIR kernels).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# ----------------------------------------------------------------------------------------------- diffusers


def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1, scale=1,
                           max_period=10000):
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half_dim, dtype=torch.float32,
                                                    device=timesteps.device)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = scale * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


class Timesteps(nn.Module):
    def __init__(self, num_channels, flip_sin_to_cos, downscale_freq_shift, scale=1):
        super().__init__()
        self.num_channels = num_channels
        self.flip_sin_to_cos = flip_sin_to_cos
        self.downscale_freq_shift = downscale_freq_shift
        self.scale = scale

    def forward(self, timesteps):
        return get_timestep_embedding(timesteps, self.num_channels, flip_sin_to_cos=self.flip_sin_to_cos,
                                      downscale_freq_shift=self.downscale_freq_shift, scale=self.scale)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels, time_embed_dim, out_dim=None):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim, True)
        self.act = nn.SiLU()  # get_activation("silu")
        self.linear_2 = nn.Linear(time_embed_dim, out_dim or time_embed_dim, True)

    def forward(self, sample):
        sample = self.linear_1(sample)
        if self.act is not None:
            sample = self.act(sample)
        sample = self.linear_2(sample)
        return sample


class ResnetBlock2D(nn.Module):
    def __init__(self, *, in_channels, out_channels=None, dropout=0.0, temb_channels=512, groups=32, eps=1e-6,
                 output_scale_factor=1.0, use_in_shortcut=None, conv_shortcut_bias=True):
        super().__init__()
        out_channels = in_channels if out_channels is None else out_channels
        self.in_channels, self.out_channels = in_channels, out_channels
        self.output_scale_factor = output_scale_factor
        self.time_embedding_norm = "default"
        self.skip_time_act = False
        self.norm1 = torch.nn.GroupNorm(num_groups=groups, num_channels=in_channels, eps=eps, affine=True)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.time_emb_proj = nn.Linear(temb_channels, out_channels) if temb_channels is not None else None
        self.norm2 = torch.nn.GroupNorm(num_groups=groups, num_channels=out_channels, eps=eps, affine=True)
        self.dropout = torch.nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.nonlinearity = nn.SiLU()  # get_activation("swish"): one module, called three times
        self.use_in_shortcut = in_channels != out_channels if use_in_shortcut is None else use_in_shortcut
        self.conv_shortcut = None
        if self.use_in_shortcut:
            self.conv_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0,
                                           bias=conv_shortcut_bias)

    def forward(self, input_tensor, temb):
        hidden_states = input_tensor
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.nonlinearity(hidden_states)
        hidden_states = self.conv1(hidden_states)
        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]
        if self.time_embedding_norm == "default":
            if temb is not None:
                hidden_states = hidden_states + temb
            hidden_states = self.norm2(hidden_states)
        hidden_states = self.nonlinearity(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)
        if self.conv_shortcut is not None:
            input_tensor = self.conv_shortcut(input_tensor.contiguous())
        output_tensor = (input_tensor + hidden_states) / self.output_scale_factor
        return output_tensor


class Downsample2D(nn.Module):
    def __init__(self, channels, use_conv=True, out_channels=None, padding=1, name="conv"):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.use_conv = use_conv
        self.padding = padding
        self.conv = nn.Conv2d(self.channels, self.out_channels, kernel_size=3, stride=2, padding=padding)

    def forward(self, hidden_states):
        assert hidden_states.shape[1] == self.channels
        if self.use_conv and self.padding == 0:
            pad = (0, 1, 0, 1)
            hidden_states = F.pad(hidden_states, pad, mode="constant", value=0)
        hidden_states = self.conv(hidden_states)
        return hidden_states


class Upsample2D(nn.Module):
    def __init__(self, channels, use_conv=True, out_channels=None, padding=1):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.use_conv = use_conv
        self.conv = nn.Conv2d(self.channels, self.out_channels, kernel_size=3, padding=padding)

    def forward(self, hidden_states, output_size=None):
        assert hidden_states.shape[1] == self.channels
        dtype = hidden_states.dtype
        if dtype == torch.bfloat16:
            hidden_states = hidden_states.to(torch.float32)
        if hidden_states.shape[0] >= 64:
            hidden_states = hidden_states.contiguous()
        if output_size is None:
            hidden_states = F.interpolate(hidden_states, scale_factor=2.0, mode="nearest")
        else:
            hidden_states = F.interpolate(hidden_states, size=output_size, mode="nearest")
        if dtype == torch.bfloat16:
            hidden_states = hidden_states.to(dtype)
        if self.use_conv:
            hidden_states = self.conv(hidden_states)
        return hidden_states


class _Processor:
    """What diffusers' attention processors share: ``[B, C, H, W]`` inputs seen as ``H * W`` tokens, the optional
    group norm, then (after :meth:`attend`) the output projection and its dropout, the shape back, the residual and
    the rescale."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        residual = hidden_states
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        attention_mask = self.mask(attn, attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        hidden_states = self.attend(attn, hidden_states, encoder_hidden_states, attention_mask, batch_size)
        hidden_states = attn.to_out[0](hidden_states)  # linear proj
        hidden_states = attn.to_out[1](hidden_states)  # dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor

    def mask(self, attn, attention_mask, sequence_length, batch_size):
        return attention_mask


class AttnProcessor(_Processor):
    """The default processor before PyTorch 2: scores by ``baddbmm`` into an uninitialised tensor (``beta=0``)."""

    def mask(self, attn, attention_mask, sequence_length, batch_size):
        return attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)

    def attend(self, attn, hidden_states, encoder_hidden_states, attention_mask, batch_size):
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        query = attn.head_to_batch_dim(query)
        key = attn.head_to_batch_dim(key)
        value = attn.head_to_batch_dim(value)
        attention_probs = attn.get_attention_scores(query, key, attention_mask)
        hidden_states = torch.bmm(attention_probs, value)
        return attn.batch_to_head_dim(hidden_states)


class AttnProcessor2_0(_Processor):
    def attend(self, attn, hidden_states, encoder_hidden_states, attention_mask, batch_size):
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                       is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        return hidden_states.to(query.dtype)


def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False):
    """diffusers' ``models/attention_dispatch.py`` with its default (native) backend, ``_native_attention``: ``[B, T,
    H, D]`` tensors permuted to ``[B, H, T, D]``, and every argument of the call passed by keyword."""
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query=query, key=key, value=value, attn_mask=attn_mask,
                                                           dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out.permute(0, 2, 1, 3)


class AttnProcessorDispatch(_Processor):
    """The processors of diffusers' newer transformers (Flux, Wan, Qwen-Image, HunyuanVideo, LTX...): heads unflattened
    to ``[B, T, H, D]`` and attention through :func:`dispatch_attention_fn`."""

    def attend(self, attn, hidden_states, encoder_hidden_states, attention_mask, batch_size):
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        key = attn.to_k(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
        hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                              is_causal=False)
        return hidden_states.flatten(2, 3).to(query.dtype)


class Attention(nn.Module):
    def __init__(self, query_dim, cross_attention_dim=None, heads=8, dim_head=64, dropout=0.0, bias=False,
                 upcast_attention=False, upcast_softmax=False, norm_num_groups=None, out_bias=True, scale_qk=True,
                 eps=1e-5, rescale_output_factor=1.0, residual_connection=False, processor=None):
        super().__init__()
        self.inner_dim = dim_head * heads
        self.query_dim = query_dim
        self.cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.upcast_attention = upcast_attention
        self.upcast_softmax = upcast_softmax
        self.rescale_output_factor = rescale_output_factor
        self.residual_connection = residual_connection
        self.dropout = dropout
        self.out_dim = query_dim
        self.scale = dim_head**-0.5 if scale_qk else 1.0
        self.heads = heads
        if norm_num_groups is not None:
            self.group_norm = nn.GroupNorm(num_channels=query_dim, num_groups=norm_num_groups, eps=eps, affine=True)
        else:
            self.group_norm = None
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_out = nn.ModuleList([])
        self.to_out.append(nn.Linear(self.inner_dim, self.out_dim, bias=out_bias))
        self.to_out.append(nn.Dropout(dropout))
        self.processor = processor if processor is not None else AttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **cross_attention_kwargs):
        return self.processor(self, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=attention_mask, **cross_attention_kwargs)

    def batch_to_head_dim(self, tensor):
        head_size = self.heads
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // head_size, head_size, seq_len, dim)
        tensor = tensor.permute(0, 2, 1, 3).reshape(batch_size // head_size, seq_len, dim * head_size)
        return tensor

    def head_to_batch_dim(self, tensor, out_dim=3):
        head_size = self.heads
        if tensor.ndim == 3:
            batch_size, seq_len, dim = tensor.shape
            extra_dim = 1
        else:
            batch_size, extra_dim, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len * extra_dim, head_size, dim // head_size)
        tensor = tensor.permute(0, 2, 1, 3)
        if out_dim == 3:
            tensor = tensor.reshape(batch_size * head_size, seq_len * extra_dim, dim // head_size)
        return tensor

    def get_attention_scores(self, query, key, attention_mask=None):
        dtype = query.dtype
        if self.upcast_attention:
            query = query.float()
            key = key.float()
        if attention_mask is None:
            baddbmm_input = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype,
                                        device=query.device)
            beta = 0
        else:
            baddbmm_input = attention_mask
            beta = 1
        attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta, alpha=self.scale)
        del baddbmm_input
        if self.upcast_softmax:
            attention_scores = attention_scores.float()
        attention_probs = attention_scores.softmax(dim=-1)
        del attention_scores
        attention_probs = attention_probs.to(dtype)
        return attention_probs

    def prepare_attention_mask(self, attention_mask, target_length, batch_size, out_dim=3):
        if attention_mask is None:
            return attention_mask
        raise NotImplementedError("masks are not transcribed")


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out, bias=True):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2, bias=bias)

    def gelu(self, gate):
        return F.gelu(gate)

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = self.proj(hidden_states)
        hidden_states, gate = hidden_states.chunk(2, dim=-1)
        return hidden_states * self.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, dim_out=None, mult=4, dropout=0.0, activation_fn="geglu", final_dropout=False,
                 inner_dim=None, bias=True):
        super().__init__()
        if inner_dim is None:
            inner_dim = int(dim * mult)
        dim_out = dim_out if dim_out is not None else dim
        assert activation_fn == "geglu"
        act_fn = GEGLU(dim, inner_dim, bias=bias)
        self.net = nn.ModuleList([])
        self.net.append(act_fn)
        self.net.append(nn.Dropout(dropout))
        self.net.append(nn.Linear(inner_dim, dim_out, bias=bias))
        if final_dropout:
            self.net.append(nn.Dropout(dropout))

    def forward(self, hidden_states, *args, **kwargs):
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, dropout=0.0, cross_attention_dim=None,
                 attention_bias=False, norm_elementwise_affine=True, norm_eps=1e-5, processor=None):
        super().__init__()
        self.only_cross_attention = False
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=norm_elementwise_affine, eps=norm_eps)
        self.attn1 = Attention(query_dim=dim, heads=num_attention_heads, dim_head=attention_head_dim,
                               dropout=dropout, bias=attention_bias, processor=processor)
        self.norm2 = nn.LayerNorm(dim, norm_eps, norm_elementwise_affine)
        self.attn2 = Attention(query_dim=dim, cross_attention_dim=cross_attention_dim, heads=num_attention_heads,
                               dim_head=attention_head_dim, dropout=dropout, bias=attention_bias, processor=processor)
        self.norm3 = nn.LayerNorm(dim, norm_eps, norm_elementwise_affine)
        self.ff = FeedForward(dim, dropout=dropout, activation_fn="geglu")

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                timestep=None):
        norm_hidden_states = self.norm1(hidden_states)
        attn_output = self.attn1(norm_hidden_states,
                                 encoder_hidden_states=encoder_hidden_states if self.only_cross_attention else None,
                                 attention_mask=attention_mask)
        hidden_states = attn_output + hidden_states
        if hidden_states.ndim == 4:
            hidden_states = hidden_states.squeeze(1)
        if self.attn2 is not None:
            norm_hidden_states = self.norm2(hidden_states)
            attn_output = self.attn2(norm_hidden_states, encoder_hidden_states=encoder_hidden_states,
                                     attention_mask=encoder_attention_mask)
            hidden_states = attn_output + hidden_states
        norm_hidden_states = self.norm3(hidden_states)
        ff_output = self.ff(norm_hidden_states)
        hidden_states = ff_output + hidden_states
        if hidden_states.ndim == 4:
            hidden_states = hidden_states.squeeze(1)
        return hidden_states


class Transformer2DModel(nn.Module):
    """Continuous input, ``use_linear_projection=True`` (Stable Diffusion 2): proj_in is a Linear on ``[B, HW, C]``."""

    def __init__(self, num_attention_heads=16, attention_head_dim=88, in_channels=None, num_layers=1, dropout=0.0,
                 norm_num_groups=32, cross_attention_dim=None, use_linear_projection=True, processor=None):
        super().__init__()
        self.use_linear_projection = use_linear_projection
        inner_dim = num_attention_heads * attention_head_dim
        self.in_channels = in_channels
        self.norm = torch.nn.GroupNorm(num_groups=norm_num_groups, num_channels=in_channels, eps=1e-6, affine=True)
        if use_linear_projection:
            self.proj_in = nn.Linear(in_channels, inner_dim)
        else:
            self.proj_in = nn.Conv2d(in_channels, inner_dim, kernel_size=1, stride=1, padding=0)
        self.transformer_blocks = nn.ModuleList([
            BasicTransformerBlock(inner_dim, num_attention_heads, attention_head_dim, dropout=dropout,
                                  cross_attention_dim=cross_attention_dim, processor=processor)
            for _ in range(num_layers)
        ])
        if use_linear_projection:
            self.proj_out = nn.Linear(inner_dim, in_channels)
        else:
            self.proj_out = nn.Conv2d(inner_dim, in_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, attention_mask=None,
                encoder_attention_mask=None, return_dict=False):
        batch, _, height, width = hidden_states.shape
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        if not self.use_linear_projection:
            hidden_states = self.proj_in(hidden_states)
            inner_dim = hidden_states.shape[1]
            hidden_states = hidden_states.permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
        else:
            inner_dim = hidden_states.shape[1]
            hidden_states = hidden_states.permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
            hidden_states = self.proj_in(hidden_states)
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, attention_mask=attention_mask,
                                  encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, timestep=timestep)
        if not self.use_linear_projection:
            hidden_states = hidden_states.reshape(batch, height, width, inner_dim).permute(0, 3, 1, 2).contiguous()
            hidden_states = self.proj_out(hidden_states)
        else:
            hidden_states = self.proj_out(hidden_states)
            hidden_states = hidden_states.reshape(batch, height, width, inner_dim).permute(0, 3, 1, 2).contiguous()
        output = hidden_states + residual
        return (output,)


class _Checkpointing:
    """diffusers' ``gradient_checkpointing`` of the UNet blocks: ``self._gradient_checkpointing_func(resnet,
    hidden_states, temb)``, i.e. ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, where grad is on."""

    gradient_checkpointing = False

    def _maybe_checkpointed(self, fn, *args, **kwargs):
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)


class CrossAttnDownBlock2D(_Checkpointing, nn.Module):
    def __init__(self, in_channels, out_channels, temb_channels, *, heads, cross_attention_dim, groups, dropout,
                 add_downsample, processor=None):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(in_channels=in_channels, out_channels=out_channels,
                                                    temb_channels=temb_channels, groups=groups, dropout=dropout)])
        self.attentions = nn.ModuleList([Transformer2DModel(heads, out_channels // heads, in_channels=out_channels,
                                                            norm_num_groups=groups, dropout=dropout,
                                                            cross_attention_dim=cross_attention_dim,
                                                            processor=processor)])
        self.downsamplers = nn.ModuleList([Downsample2D(out_channels)]) if add_downsample else None

    def forward(self, hidden_states, temb=None, encoder_hidden_states=None):
        output_states = ()
        for resnet, attn in zip(self.resnets, self.attentions, strict=True):
            hidden_states = self._maybe_checkpointed(resnet, hidden_states, temb)
            hidden_states = self._maybe_checkpointed(attn, hidden_states,
                                                     encoder_hidden_states=encoder_hidden_states)[0]
            output_states = (*output_states, hidden_states)
        if self.downsamplers is not None:
            for downsampler in self.downsamplers:
                hidden_states = downsampler(hidden_states)
            output_states = (*output_states, hidden_states)
        return hidden_states, output_states


class DownBlock2D(_Checkpointing, nn.Module):
    def __init__(self, in_channels, out_channels, temb_channels, *, groups, dropout):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(in_channels=in_channels, out_channels=out_channels,
                                                    temb_channels=temb_channels, groups=groups, dropout=dropout)])
        self.downsamplers = None

    def forward(self, hidden_states, temb=None):
        output_states = ()
        for resnet in self.resnets:
            hidden_states = self._maybe_checkpointed(resnet, hidden_states, temb)
            output_states = (*output_states, hidden_states)
        return hidden_states, output_states


class UNetMidBlock2DCrossAttn(_Checkpointing, nn.Module):
    def __init__(self, in_channels, temb_channels, *, heads, cross_attention_dim, groups, dropout, processor=None):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(in_channels=in_channels, temb_channels=temb_channels,
                                                    groups=groups, dropout=dropout) for _ in range(2)])
        self.attentions = nn.ModuleList([Transformer2DModel(heads, in_channels // heads, in_channels=in_channels,
                                                            norm_num_groups=groups, dropout=dropout,
                                                            cross_attention_dim=cross_attention_dim,
                                                            processor=processor)])

    def forward(self, hidden_states, temb=None, encoder_hidden_states=None):
        hidden_states = self._maybe_checkpointed(self.resnets[0], hidden_states, temb)
        for attn, resnet in zip(self.attentions, self.resnets[1:], strict=True):
            hidden_states = self._maybe_checkpointed(attn, hidden_states,
                                                     encoder_hidden_states=encoder_hidden_states)[0]
            hidden_states = self._maybe_checkpointed(resnet, hidden_states, temb)
        return hidden_states


class UpBlock2D(_Checkpointing, nn.Module):
    """``layers_per_block + 1`` resnets, each on the hidden states concatenated with a skip, then an upsampler."""

    def __init__(self, in_channels, prev_output_channel, out_channels, temb_channels, *, groups, dropout,
                 add_upsample, num_layers=2):
        super().__init__()
        self.resnets = nn.ModuleList([
            ResnetBlock2D(in_channels=(prev_output_channel if i == 0 else out_channels)
                          + (in_channels if i == num_layers - 1 else out_channels),
                          out_channels=out_channels, temb_channels=temb_channels, groups=groups, dropout=dropout)
            for i in range(num_layers)
        ])
        self.upsamplers = nn.ModuleList([Upsample2D(out_channels)]) if add_upsample else None

    def forward(self, hidden_states, res_hidden_states_tuple, temb=None):
        for resnet in self.resnets:
            res_hidden_states = res_hidden_states_tuple[-1]
            res_hidden_states_tuple = res_hidden_states_tuple[:-1]
            hidden_states = torch.cat([hidden_states, res_hidden_states], dim=1)
            hidden_states = self._maybe_checkpointed(resnet, hidden_states, temb)
        if self.upsamplers is not None:
            for upsampler in self.upsamplers:
                hidden_states = upsampler(hidden_states)
        return hidden_states


class CrossAttnUpBlock2D(_Checkpointing, nn.Module):
    def __init__(self, in_channels, prev_output_channel, out_channels, temb_channels, *, heads, cross_attention_dim,
                 groups, dropout, num_layers=2, processor=None):
        super().__init__()
        self.resnets = nn.ModuleList([
            ResnetBlock2D(in_channels=(prev_output_channel if i == 0 else out_channels)
                          + (in_channels if i == num_layers - 1 else out_channels),
                          out_channels=out_channels, temb_channels=temb_channels, groups=groups, dropout=dropout)
            for i in range(num_layers)
        ])
        self.attentions = nn.ModuleList([
            Transformer2DModel(heads, out_channels // heads, in_channels=out_channels, norm_num_groups=groups,
                               dropout=dropout, cross_attention_dim=cross_attention_dim, processor=processor)
            for _ in range(num_layers)
        ])
        self.upsamplers = None

    def forward(self, hidden_states, res_hidden_states_tuple, temb=None, encoder_hidden_states=None):
        for resnet, attn in zip(self.resnets, self.attentions, strict=True):
            res_hidden_states = res_hidden_states_tuple[-1]
            res_hidden_states_tuple = res_hidden_states_tuple[:-1]
            hidden_states = torch.cat([hidden_states, res_hidden_states], dim=1)
            hidden_states = self._maybe_checkpointed(resnet, hidden_states, temb)
            hidden_states = self._maybe_checkpointed(attn, hidden_states,
                                                     encoder_hidden_states=encoder_hidden_states)[0]
        return hidden_states


class TinyUNet2DCondition(nn.Module):
    """``UNet2DConditionModel(block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D",
    "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
    norm_num_groups=8, cross_attention_dim=ctx_dim, attention_head_dim=8)``, with its op sequence: conv_in, the
    sinusoidal time projection and TimestepEmbedding, down blocks keeping skips, the cross-attention mid block,
    up blocks concatenating the skips, GroupNorm, SiLU, conv_out. ``processor`` picks every attention's
    processor (``AttnProcessor2_0`` by default, or the baddbmm ``AttnProcessor``)."""

    def __init__(self, in_channels=4, out_channels=4, channels=(32, 64), ctx_dim=48, heads=4, groups=8,
                 dropout=0.0, processor=None):
        super().__init__()
        c0, c1 = channels
        temb = c0 * 4
        self.conv_in = nn.Conv2d(in_channels, c0, kernel_size=3, padding=1)
        self.time_proj = Timesteps(c0, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedding = TimestepEmbedding(c0, temb)
        kw = {"groups": groups, "dropout": dropout}
        self.down_blocks = nn.ModuleList([
            CrossAttnDownBlock2D(c0, c0, temb, heads=heads, cross_attention_dim=ctx_dim, add_downsample=True,
                                 processor=processor, **kw),
            DownBlock2D(c0, c1, temb, **kw),
        ])
        self.mid_block = UNetMidBlock2DCrossAttn(c1, temb, heads=heads, cross_attention_dim=ctx_dim,
                                                 processor=processor, **kw)
        self.up_blocks = nn.ModuleList([
            UpBlock2D(c0, c1, c1, temb, add_upsample=True, **kw),
            CrossAttnUpBlock2D(c0, c1, c0, temb, heads=heads, cross_attention_dim=ctx_dim, processor=processor,
                               **kw),
        ])
        self.conv_norm_out = nn.GroupNorm(num_channels=c0, num_groups=groups, eps=1e-5)
        self.conv_act = nn.SiLU()
        self.conv_out = nn.Conv2d(c0, out_channels, kernel_size=3, padding=1)

    def enable_gradient_checkpointing(self):
        for module in self.modules():
            if isinstance(module, _Checkpointing):
                module.gradient_checkpointing = True

    def forward(self, sample, timestep, encoder_hidden_states):
        timesteps = timestep
        if not torch.is_tensor(timesteps):
            timesteps = torch.tensor([timesteps], dtype=torch.long, device=sample.device)
        timesteps = timesteps.expand(sample.shape[0])
        t_emb = self.time_proj(timesteps)
        t_emb = t_emb.to(dtype=sample.dtype)
        emb = self.time_embedding(t_emb)
        sample = self.conv_in(sample)
        down_block_res_samples = (sample,)
        for downsample_block in self.down_blocks:
            if isinstance(downsample_block, CrossAttnDownBlock2D):
                sample, res_samples = downsample_block(hidden_states=sample, temb=emb,
                                                       encoder_hidden_states=encoder_hidden_states)
            else:
                sample, res_samples = downsample_block(hidden_states=sample, temb=emb)
            down_block_res_samples += res_samples
        sample = self.mid_block(sample, emb, encoder_hidden_states=encoder_hidden_states)
        for upsample_block in self.up_blocks:
            res_samples = down_block_res_samples[-len(upsample_block.resnets):]
            down_block_res_samples = down_block_res_samples[: -len(upsample_block.resnets)]
            if isinstance(upsample_block, CrossAttnUpBlock2D):
                sample = upsample_block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res_samples,
                                        encoder_hidden_states=encoder_hidden_states)
            else:
                sample = upsample_block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res_samples)
        sample = self.conv_norm_out(sample)
        sample = self.conv_act(sample)
        sample = self.conv_out(sample)
        return sample


class UNetMidBlock2D(_Checkpointing, nn.Module):
    """The VAE's mid block: resnet, attention over the ``H * W`` positions (GroupNorm first, one head per
    ``attention_head_dim`` channels, residual inside the attention, softmax upcast), resnet; no time embedding."""

    def __init__(self, in_channels, *, groups=8, attention_head_dim=16, dropout=0.0, processor=None, eps=1e-6):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(in_channels=in_channels, temb_channels=None, groups=groups,
                                                    dropout=dropout, eps=eps) for _ in range(2)])
        self.attentions = nn.ModuleList([
            Attention(in_channels, heads=in_channels // attention_head_dim, dim_head=attention_head_dim,
                      rescale_output_factor=1.0, eps=eps, norm_num_groups=groups, residual_connection=True,
                      bias=True, upcast_softmax=True, processor=processor)
        ])

    def forward(self, hidden_states, temb=None):
        hidden_states = self._maybe_checkpointed(self.resnets[0], hidden_states, temb)
        for attn, resnet in zip(self.attentions, self.resnets[1:], strict=True):
            hidden_states = self._maybe_checkpointed(attn, hidden_states, temb=temb)
            hidden_states = self._maybe_checkpointed(resnet, hidden_states, temb)
        return hidden_states


# ------------------------------------------------------------------------------------------------ timm, DiT


def _to_2tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x, x)


class PatchEmbed(nn.Module):
    """timm's ``layers/patch_embed.py`` (NCHW in, flatten to ``[B, N, C]``)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None, flatten=True,
                 bias=True):
        super().__init__()
        self.patch_size = _to_2tuple(patch_size)
        self.img_size = _to_2tuple(img_size)
        self.grid_size = tuple([s // p for s, p in zip(self.img_size, self.patch_size, strict=True)])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = flatten
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x):
        _, _, H, W = x.shape
        assert H == self.img_size[0], f"Input height ({H}) doesn't match model ({self.img_size[0]})."
        assert W == self.img_size[1], f"Input width ({W}) doesn't match model ({self.img_size[1]})."
        x = self.proj(x)
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        x = self.norm(x)
        return x


class TimmAttention(nn.Module):
    """timm's ``vision_transformer.Attention`` (``fused_attn``: ``F.scaled_dot_product_attention``; else the
    explicit ``q @ k^T``, softmax, dropout, ``@ v``). Named ``Attention`` in timm; its name here keeps it apart
    from diffusers' (both contain "Attention", as slimact reads class names)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, attn_drop=0.0, proj_drop=0.0,
                 norm_layer=nn.LayerNorm, fused_attn=True):
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Mlp(nn.Module):
    """timm's ``layers/mlp.Mlp``."""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, norm_layer=None,
                 bias=True, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        bias = _to_2tuple(bias)
        drop_probs = _to_2tuple(drop)
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias[0])
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.norm = norm_layer(hidden_features) if norm_layer is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias[1])
        self.drop2 = nn.Dropout(drop_probs[1])

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(
            -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half
        ).to(device=t.device)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t):
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        t_emb = self.mlp(t_freq)
        return t_emb


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes, hidden_size, dropout_prob):
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels, force_drop_ids=None):
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        labels = torch.where(drop_ids, self.num_classes, labels)
        return labels

    def forward(self, labels, train, force_drop_ids=None):
        use_dropout = self.dropout_prob > 0
        if (train and use_dropout) or (force_drop_ids is not None):
            labels = self.token_drop(labels, force_drop_ids)
        embeddings = self.embedding_table(labels)
        return embeddings


class DiTBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, **block_kwargs):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = TimmAttention(hidden_size, num_heads=num_heads, qkv_bias=True, **block_kwargs)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        approx_gelu = lambda: nn.GELU(approximate="tanh")  # noqa: E731 (DiT's own)
        self.mlp = Mlp(in_features=hidden_size, hidden_features=mlp_hidden_dim, act_layer=approx_gelu, drop=0)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        x = modulate(self.norm_final(x), shift, scale)
        x = self.linear(x)
        return x


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)
    grid = np.stack(grid, axis=0)
    grid = grid.reshape([2, 1, grid_size, grid_size])
    return get_2d_sincos_pos_embed_from_grid(embed_dim, grid)


def get_2d_sincos_pos_embed_from_grid(embed_dim, grid):
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=1)


def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    pos = pos.reshape(-1)
    out = np.einsum("m,d->md", pos, omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


class DiT(nn.Module):
    gradient_checkpointing = False

    def __init__(self, input_size=16, patch_size=4, in_channels=4, hidden_size=64, depth=2, num_heads=4,
                 mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=10, learn_sigma=True, **block_kwargs):
        super().__init__()
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio, **block_kwargs)
                                     for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(_basic_init)
        pos_embed = get_2d_sincos_pos_embed(self.pos_embed.shape[-1], int(self.x_embedder.num_patches**0.5))
        self.pos_embed.data.copy_(torch.from_numpy(pos_embed).float().unsqueeze(0))
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

    def unpatchify(self, x):
        c = self.out_channels
        p = self.x_embedder.patch_size[0]
        h = w = int(x.shape[1] ** 0.5)
        assert h * w == x.shape[1]
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        imgs = x.reshape(shape=(x.shape[0], c, h * p, h * p))
        return imgs

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        t = self.t_embedder(t)
        y = self.y_embedder(y, self.training)
        c = t + y
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():  # (not in DiT's models.py: fast-DiT's)
                x = checkpoint(block, x, c, use_reentrant=False)
            else:
                x = block(x, c)
        x = self.final_layer(x, c)
        x = self.unpatchify(x)
        return x

    def forward_with_cfg(self, x, t, y, cfg_scale):
        half = x[: len(x) // 2]
        combined = torch.cat([half, half], dim=0)
        model_out = self.forward(combined, t, y)
        eps, rest = model_out[:, :3], model_out[:, 3:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        eps = torch.cat([half_eps, half_eps], dim=0)
        return torch.cat([eps, rest], dim=1)


def randomise_zero_init(model: DiT, seed: int = 0) -> DiT:
    """DiT with its zero-initialised adaLN modulations and final layer drawn at random (as after some training),
    so that every path carries gradient."""
    gen = torch.Generator().manual_seed(seed)
    zeroed = [m.adaLN_modulation[-1] for m in model.blocks] + [model.final_layer.adaLN_modulation[-1],
                                                                 model.final_layer.linear]
    with torch.no_grad():
        for lin in zeroed:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.05)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen) * 0.05)
    return model
