import pytest
import torch
from torch import nn

from _harness import FLOAT_DTYPES, check_against_plain, non_contiguous, saved_ratio


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (3, 7, 33), "non-contiguous"], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_is_exact_with_the_same_draws(shape, dtype, p):
    x = non_contiguous(3, 9, 17) if shape == "non-contiguous" else torch.randn(shape)
    check_against_plain(nn.Dropout(p), x.to(dtype), exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("p", [0.15, 0.3, 0.42, 0.9])
def test_dropout_is_f_dropout_bit_for_bit_forward_and_backward(p, dtype):
    # F.dropout on the CPU multiplies by its noise, bernoulli_(1 - p) divided in place by 1 - p in the input's dtype:
    # 1 / (1 - p) rounded through that dtype, forward and backward. slimact multiplied by float32(1 / (1 - p)) in fp32
    # (1 ulp off at p = 0.15 and 0.42: 15 of p = 0.01, ..., 0.99, forward and gradient) and scaled fp16/bf16
    # gradients in fp32 (native_dropout_backward: 1 ulp off at most p).
    from slimact.functional import dropout

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen).to(dtype)
    up = torch.randn(64, 256, generator=gen).to(dtype)
    results = []
    for fn in (nn.functional.dropout, dropout):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(5)
        y = fn(xi, p, True)
        y.backward(up)
        results.append((y.detach(), xi.grad))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y1, y0) and torch.equal(g1, g0)


def test_dropout_keeps_bits():
    ratio = saved_ratio(nn.Dropout(0.1), torch.randn(256, 256))
    assert ratio <= 0.125 + 1e-9  # PyTorch keeps a one-byte bool mask; slimact keeps one bit


def test_eval_dropout_is_identity():
    from _harness import converted_copy

    drop = converted_copy(nn.Dropout(0.5)).eval()
    x = torch.randn(10)
    assert torch.equal(drop(x), x)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_cpu_fp32_dropout_equals_native_dropout_bit_for_bit(layout, compiled, monkeypatch):
    # slimact's CPU fp32 dropout draws the mask into bool and applies (x * mask) * scale in one loop, forward and
    # backward: the same mask, output, gradient and generator state after it as torch.native_dropout and its
    # backward, at a size where the loop is compiled, at 1 and 2 threads.
    from slimact.functional import dropout
    from slimact.quant import inductor

    if not compiled:
        monkeypatch.setattr(inductor, "fused", lambda *a: None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, 768, generator=gen)
    x = x if layout == "contiguous" else x.transpose(1, 2)
    up = torch.randn(x.shape, generator=gen)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            ref, mask = torch.native_dropout(x, 0.1, True)
            ref_grad = torch.ops.aten.native_dropout_backward(up, mask, 1 / 0.9)
            ref_state = torch.get_rng_state()
            torch.manual_seed(5)
            xi = x.detach().requires_grad_(True)
            y = dropout(xi, 0.1)
            assert torch.equal(torch.get_rng_state(), ref_state)
            y.backward(up)
            assert torch.equal(y, ref) and torch.equal(xi.grad, ref_grad)
    finally:
        torch.set_num_threads(before)


def test_cpu_fp32_dropout_makes_two_passes_forward_and_one_backward():
    # Plain native_dropout on the CPU: a bool draw, the mask converted to fp32, two multiplies; its backward a
    # conversion and two multiplies. Here: the draw and one compiled loop, then one loop (besides the bits).
    from torch.profiler import ProfilerActivity, profile

    import slimact.functional._bernoulli as _bernoulli
    from slimact.functional import dropout

    x = torch.randn(4, 256, 768, requires_grad=True)
    up = torch.randn(x.shape)
    dropout(x, 0.1).backward(up)  # compiles the loop
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dropout(x, 0.1).backward(up)
    events = prof.events()
    # one draw: by slimact's bernoulli_ kernel where it is available (no aten op then), else aten's
    assert [e.name for e in events].count("aten::bernoulli_") == (0 if _bernoulli._load() else 1)
    assert not {"aten::native_dropout", "aten::native_dropout_backward"} & {e.name for e in events}
    # (the mask's bits are packed and unpacked by their own ops, over int64 words: x.numel() / 8 of them)
    passes = [e.name for e in events if e.name in ("aten::mul", "aten::mul_", "aten::to", "aten::copy_")
              and any(tuple(shape) == tuple(x.shape) for shape in e.input_shapes if shape)]
    assert not passes, passes
