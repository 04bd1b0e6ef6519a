"""Shared checks: a converted module against the plain one it replaces, and the bytes it keeps."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import slimact
from slimact._metrics import sqnr_db
from slimact.nn import SlimModule

FLOAT_DTYPES = [torch.float32, torch.bfloat16]


def upstream_loss(out: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    """``(out * upstream).sum()``, whose backward sends ``upstream`` to ``out`` as ``out.backward(upstream)`` does,
    keeping nothing of ``out``. Drop ``out`` before its backward (``loss, out = upstream_loss(out, g), out.detach()``)
    to test a lossy Function's backward from what it kept, as inside a model: a softmax uses its own output instead
    of its codes wherever that output is still alive (slimact.functional.softmax), as a test's ``out`` is."""
    return (out * upstream.to(out.dtype)).sum()


def _step(module: nn.Module, inputs: tuple[torch.Tensor, ...], seed: int):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    torch.manual_seed(seed)
    out = module(*xs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.dtype)
    loss, out = upstream_loss(out, upstream), out.detach()
    loss.backward()
    grads = {f"input{i}": x.grad for i, x in enumerate(xs) if x.grad is not None}
    grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    return out, grads


def estimates(model: nn.Module) -> dict[str, torch.Tensor]:
    """The running estimates ``model`` holds now, ``{"<module>.<prefix>_lo" | "..._range": tensor}`` (the live
    tensors, not copies; :func:`slimact.state_dict` gives copies)."""
    from slimact.quant.state import ESTIMATES_ATTR

    return {f"{name}.{n}" if name else n: t for name, m in model.named_modules()
            for n, t in m.__dict__.get(ESTIMATES_ATTR, {}).items()}


def converted_copy(plain: nn.Module, policy="int8") -> nn.Module:
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert any(isinstance(m, SlimModule) for m in slim.modules()), "nothing was converted"
    return slim


def check_against_plain(plain: nn.Module, *inputs: torch.Tensor, policy="int8", floor_db=30.0, exact=False):
    """Forward identical to the plain module's; every gradient within ``floor_db`` SQNR (or equal if exact)."""
    plain = plain.train()
    slim = converted_copy(plain, policy).train()
    out0, g0 = _step(plain, inputs, seed=1)
    out1, g1 = _step(slim, inputs, seed=1)
    assert torch.equal(out0, out1), "forward differs from PyTorch's"
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        if exact:
            torch.testing.assert_close(g1[name], g0[name], msg=name)
        else:
            db = sqnr_db(g0[name], g1[name])
            assert db >= floor_db, f"{name}: {db:.1f} dB < {floor_db} dB"
    return slim


def saved_ratio(plain: nn.Module, *inputs: torch.Tensor, policy="int8") -> float:
    """Bytes the converted module keeps for backward over what the plain fp32 module keeps."""
    xs = tuple(x.detach().requires_grad_(True) for x in inputs)
    before = slimact.profile(plain, xs).activation_bytes
    after = slimact.profile(converted_copy(plain, policy), xs).activation_bytes
    return after / before


def non_contiguous(*shape: int) -> torch.Tensor:
    """A tensor of ``shape`` read through transposed strides."""
    return torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)


def tiny_hf(name: str, *, padding: bool = False, mlm_mask: bool = False, heads: int = 4, kv_heads: int | None = None):
    """A small random Hugging Face model and a training batch: ``"bert"``, ``"gpt2"``, ``"llama"``, ``"vit"``.

    ``padding``: BERT's batch pads its second row; ``mlm_mask``: BERT's labels only on ~30% of the tokens;
    ``heads``/``kv_heads``: Llama's query and key/value heads (grouped-query attention).
    """
    import transformers

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 32), generator=gen)
    if name == "bert":
        cfg = transformers.BertConfig(
            vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            max_position_embeddings=64,
        )
        inputs = {"input_ids": ids, "labels": ids}
        if mlm_mask:
            inputs["labels"] = torch.where(torch.rand(2, 32, generator=gen) < 0.3, ids, torch.full_like(ids, -100))
        if padding:
            mask = torch.ones_like(ids)
            mask[1, 20:] = 0
            inputs["attention_mask"] = mask
        return transformers.BertForMaskedLM(cfg), inputs
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=96, hidden_size=16 * heads, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=kv_heads or heads // 2, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
        return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    if name == "vit":
        cfg = transformers.ViTConfig(
            image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, num_labels=10,
        )
        inputs = {"pixel_values": torch.randn(4, 3, 32, 32, generator=gen), "labels": torch.randint(0, 10, (4,))}
        return transformers.ViTForImageClassification(cfg), inputs
    raise ValueError(name)


def tiny_auto(cls_name: str, model_type: str) -> nn.Module:
    """transformers' ``cls_name`` built from :func:`slimact.zoo.tiny_config` of ``model_type``, in training mode; the
    test is skipped where the installed transformers has no such model at that size."""
    pytest.importorskip("transformers")
    from slimact.zoo import build_auto, tiny_config

    try:
        return build_auto(cls_name, tiny_config(model_type)).train()
    except (ImportError, KeyError, ValueError, AttributeError) as e:
        pytest.skip(f"this transformers has no {cls_name} at the tiny size: {e}")


class Gradients(dict):
    """``{name: grad}`` that also knows each weight's output dim (:attr:`dims`, ``slimact.check``'s), so that
    :func:`assert_gradients_close` judges the parts of a fused projection (q, k, v) as ``check`` does."""

    dims: dict[str, int]


def gradients(model: nn.Module) -> Gradients:
    """The gradients ``model``'s parameters hold now (cloned), with their output dims."""
    from slimact.check import _output_dims

    grads = Gradients((n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None)
    grads.dims = _output_dims(model)
    return grads


def loss_grads(model: nn.Module, inputs: dict):
    """``(loss, {name: grad})`` of one training step, with the dropout masks of seed 1."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), gradients(model)


def assert_gradients_close(exact: dict, approx: dict, min_cosine: float = 0.99, zeros: set | None = None,
                           gold: dict | None = None) -> None:
    """Every gradient at cosine >= ``min_cosine``; one that is zero in exact arithmetic (a key bias: softmax
    ignores a per-row shift; embeddings of tokens not in the batch) only has to stay at noise level, a
    fraction of an 8-bit step (1/255) of a typical gradient. ``zeros`` names those gradients when ``exact``
    is itself computed in low precision (bf16 leaves them at up to 1e-4 of a typical gradient); by default
    they are the ones below 1e-6 of a typical gradient.

    ``gold``: when ``exact`` is PyTorch's own low-precision run (autocast), the fp32 gradients, which are then
    the truth: each of ``approx`` must be at ``min_cosine`` from ``gold``, or as close to it as PyTorch's own
    low-precision gradient is (a bf16 LayerNorm bias gradient summed over few rows can sit at 0.97 from fp32;
    which side of 0.99 it falls on changes with the thread count).

    Beyond the cosine, each gradient is judged as :func:`slimact.check` judges a lossy one: its norm within
    ``MAX_NORM_RATIO`` of plain's (a cosine cannot see a scale: every Linear weight gradient 1.25x passed), and,
    where the gradients know their weights' output dims (:class:`Gradients`), each part of a fused projection on
    its own (GPT-2's ``c_attn`` with its query part negated kept cosine 0.9999)."""
    from slimact._metrics import cosine
    from slimact.check import MIN_COSINE, NOISE, _misses

    assert exact.keys() == approx.keys()
    typical = torch.stack([g.norm() for g in exact.values()]).median()
    zeros = zero_gradients(exact) if zeros is None else zeros
    dims = getattr(exact, "dims", None) or getattr(approx, "dims", None) or {}
    for n in exact:
        if n in zeros:
            assert approx[n].norm() <= 1e-3 * typical, n
        elif gold is None:
            assert cosine(exact[n], approx[n]) >= min_cosine, n
            if min_cosine >= MIN_COSINE:  # (check's judge holds its own floor: a caller asking less gets the cosine)
                why = _misses(exact[n], approx[n], False, 0.0, dims.get(n), bound=NOISE * typical.item())
                assert not why, (n, why)
        else:
            floor = min(min_cosine, cosine(gold[n], exact[n]))
            assert cosine(gold[n], approx[n]) >= floor, (n, floor)


def assert_gradients_equal(exact: dict, approx: dict) -> None:
    """Every gradient equal to float rounding, as :func:`slimact.check` judges a lossless policy: normwise,
    ``||g - g_exact|| <= tol * ||g_exact||``, and one that is negligible (zero in exact arithmetic) within ``tol`` of
    a typical gradient. Elementwise tolerances fail on float rounding alone wherever slimact and PyTorch add a
    sum in another order (a different attention kernel; a weight gradient of magnitude 75 carries 1e-5 of it)."""
    from slimact.check import _judge

    assert exact.keys() == approx.keys() and exact
    typical = torch.stack([g.double().norm() for g in exact.values()]).median().item()
    for n in exact:
        verdict = _judge(n, exact[n], approx[n], typical, lossless=True)
        assert verdict.passed, f"{n}: {verdict.reason}"


def zero_gradients(grads: dict) -> set:
    """Names of the gradients that are zero in exact arithmetic (fp32 ones below 1e-6 of a typical one)."""
    typical = torch.stack([g.norm() for g in grads.values()]).median()
    return {n for n, g in grads.items() if g.norm() <= 1e-6 * typical}


def backward_nodes(y: torch.Tensor) -> list:
    """Every node of ``y``'s autograd graph (each once)."""
    seen, todo = [], [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or any(node is s for s in seen):
            continue
        seen.append(node)
        todo += [n for n, _ in node.next_functions]
    return seen


class HandWrittenAttention(nn.Module):
    """Attention written in model code over a fused ``qkv`` projection: softmax probabilities, their scores soft-capped
    by a tanh where ``cap`` is given (Gemma 2's, Grok's: the tanh keeps its fp32 ``[B, H, T, S]`` input in full), or
    ``sigmoid`` ones (x-transformers' ``attn_sigmoid``: the sigmoid keeps its probabilities in full)."""

    def __init__(self, width: int = 64, heads: int = 4, *, cap: float | None = None, sigmoid: bool = False) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads
        self.cap, self.sigmoid = cap, sigmoid

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) * (C // self.heads) ** -0.5
        if self.sigmoid:
            p = torch.sigmoid(s - math.log(T))
        else:
            p = (s if self.cap is None else self.cap * torch.tanh(s / self.cap)).softmax(-1)
        return self.proj((p @ v).transpose(1, 2).reshape(B, T, C))


class LinearOnlyWeight(torch.Tensor):
    """A frozen weight that takes part in ``F.linear`` only, as torchao's quantised weights do (its ``Int8Tensor``
    implements ``F.linear`` at the torch-function level, and no ``aten.mm`` with it as the second operand): int8 codes
    and a scale per output row, restored inside ``F.linear``; any op on it other than ``detach`` raises."""

    @staticmethod
    def __new__(cls, codes, scale):
        out = torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=scale.dtype, device=codes.device)
        out.codes, out.scale = codes, scale
        return out

    def __init__(self, codes, scale):
        super().__init__()

    @classmethod
    def of(cls, weight):
        scale = weight.detach().abs().amax(1, keepdim=True) / 127
        return cls((weight.detach() / scale).round().to(torch.int8), scale)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            x, w, *rest = args
            return func(x, w.codes.to(w.scale.dtype) * w.scale, *rest, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0].codes, args[0].scale)
        raise NotImplementedError(f"{cls.__name__} has no {func}")


def quantised_llama(quantise, when: str, policy: str = "int8"):
    """A tiny Llama, plain and converted, with ``quantise(model)`` (weights made :class:`LinearOnlyWeight`) applied
    to both, ``"before convert"`` or ``"after convert"``: ``(converted, (loss, grads) plain, (loss, grads) converted)``
    of one training step."""
    base, inputs = tiny_hf("llama")
    plain, slim = copy.deepcopy(base), copy.deepcopy(base)
    quantise(plain)
    if when == "before convert":
        quantise(slim)
    slimact.convert(slim, policy)
    if when == "after convert":
        quantise(slim)
    return slim, loss_grads(plain, inputs), loss_grads(slim, inputs)
