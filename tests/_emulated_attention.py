"""CPU stand-ins for PyTorch's fused CUDA attention kernels, for tests of slimact's fused path on a machine with no
GPU (tests/functional/test_attention.py, tests/functional/test_functions.py)."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch

import slimact.functional.attention as attention_mod


class _Emulated:
    """CPU stand-ins for the fused CUDA ops: math attention in float64 (the output rounded to the inputs' dtype,
    the log-sum-exp fp32, as the kernels return them); dropout drawn with ``torch.rand`` from the CPU generator
    (no Philox) and recorded under a "seed" id, so a backward uses the mask its seed names. Checks what the
    kernels require: equal heads, inputs in their own dtype, an aligned 4-d bias in the query's dtype."""

    def __init__(self):
        self.log = []  # (kind, "forward" | "backward", details)
        self.masks = {}  # seed -> keep mask
        self.inside = False

    def ops(self):
        return {"flash": (self.flash_forward, self.flash_backward),
                "efficient": (self.efficient_forward, self.efficient_backward)}

    def _check(self, q, k, v, bias):
        assert q.shape[1] == k.shape[1] == v.shape[1], "the kernels take equal heads"
        assert q.dtype == k.dtype == v.dtype and all(t.stride(-1) == 1 for t in (q, k, v))
        if bias is not None:
            assert bias.dim() == 4 and bias.shape == (*q.shape[:3], k.shape[2]) and bias.dtype == q.dtype
            assert bias.stride(-1) == 1 and all(st % 16 == 0 for st in bias.stride()[:3]), bias.stride()

    def _attend(self, q, k, v, bias, p, causal, scale, keep):
        s = q.double() @ k.double().transpose(-1, -2) * scale
        if bias is not None:
            s = s + bias.double()
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
        lse = torch.logsumexp(s, -1)
        probs = torch.exp(s - lse[..., None])
        if keep is not None:
            probs = probs * keep / (1 - p)
        return probs @ v.double(), lse

    def _forward(self, kind, q, k, v, bias, p, causal, scale):
        self.inside = True
        try:
            self._check(q, k, v, bias)
            keep = (torch.rand(*q.shape[:3], k.shape[2], dtype=torch.float64) >= p) if p > 0 else None
            seed = len(self.masks)
            self.masks[seed] = keep
            out, lse = self._attend(q, k, v, bias, p, causal, scale, keep)
            out, lse = out.to(q.dtype), lse.float()
            self.log.append((kind, "forward", {"out": out, "lse": lse, "seed": seed, "dtype": q.dtype}))
            return out, lse, torch.tensor(seed), torch.tensor(1000 + seed)
        finally:
            self.inside = False

    def _backward(self, kind, grad, q, k, v, bias, out, lse, seed, offset, p, causal, scale):
        self.inside = True
        try:
            self._check(q, k, v, bias)
            assert int(offset) == 1000 + int(seed)
            keep = self.masks[int(seed)]
            self.log.append((kind, "backward", {"out": out, "lse": lse, "seed": int(seed), "dtype": q.dtype}))
            # As the kernels' backward: the probabilities recomputed as exp(s - lse) from the lse given and the row
            # sum as rowsum(dO * O) from the output given (what lets slimact hand them attention sinks' rescaled
            # output and lse). The output given must be that of those probabilities, in the rows that have a
            # gradient (a fully masked row's output is zeroed, and so is its gradient).
            s = q.double() @ k.double().transpose(-1, -2) * scale
            if bias is not None:
                s = s + bias.double()
            if causal:
                s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
            probs = torch.exp(s - lse.double()[..., : q.shape[2], None])
            factor = 1.0 if keep is None else keep / (1 - p)
            rows = grad.ne(0).any(-1)
            o = (probs * factor) @ v.double()
            torch.testing.assert_close(out[rows], o.to(out.dtype)[rows])
            g = grad.double()
            gv = (probs * factor).transpose(-1, -2) @ g
            dp = (g @ v.double().transpose(-1, -2)) * factor
            # rowsum(dO * O) of that output unrounded (the kernels' rounding of it is theirs: not emulated)
            ds = probs * (dp - (g * o).sum(-1, keepdim=True))
            gq, gk = ds @ k.double() * scale, ds.transpose(-1, -2) @ q.double() * scale
            return tuple(x.to(q.dtype) for x in (gq, gk, gv))
        finally:
            self.inside = False

    def flash_forward(self, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                      scale=None):
        out, lse, seed, offset = self._forward("flash", query, key, value, None, dropout_p, is_causal, scale)
        return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, torch.empty(0)

    def flash_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        assert (max_q, max_k) == (query.shape[2], key.shape[2])
        return self._backward("flash", grad_out, query, key, value, None, out, logsumexp, philox_seed, philox_offset,
                              dropout_p, is_causal, scale)

    def efficient_forward(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                          *, scale=None):
        assert compute_log_sumexp
        out, lse, seed, offset = self._forward("efficient", query, key, value, attn_bias, dropout_p, is_causal, scale)
        # as the kernel returns it: [B, H, T, D] seen on [B, T, H, D] memory
        return out.transpose(1, 2).contiguous().transpose(1, 2), lse, seed, offset

    def efficient_backward(self, grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                           dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        assert list(grad_input_mask) == [True, True, True, False]
        # The fp16/bf16 kernel computes rowsum(dO * O) itself, reading the output with the strides of the layout its
        # forward returned (an output made contiguous, by an out-of-place masked_fill say, was misread on an H200:
        # q and k gradients 80% off, v's right); the fp32 kernel takes it as it is.
        if query.dtype != torch.float32:
            assert out.transpose(1, 2).is_contiguous(), out.stride()
        grads = self._backward("efficient", grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed,
                               philox_offset, dropout_p, is_causal, scale)
        return (*grads, None)


@contextlib.contextmanager
def emulated_fused_attention():
    """slimact's fused attention path taken on the CPU, with :class:`_Emulated`'s ops for the CUDA kernels."""
    emu = _Emulated()
    with mock.patch.object(attention_mod, "_fused_device", lambda device: True), \
            mock.patch.object(attention_mod, "FUSED_OPS", emu.ops()):
        yield emu
