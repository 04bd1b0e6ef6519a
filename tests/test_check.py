"""``slimact.check`` and ``slimact check``: a model that converts correctly passes under "int8" and "tempo",
the user's model is left exactly as found, a deliberately broken policy is reported as a failure (naming the
parameters), the floors tell rounding from a real error, and the command line's exit code follows the verdict."""

import contextlib
import copy
import importlib
import typing

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimact
from slimact import Policy, zoo
from slimact.check import MIN_COSINE, NOISE, _judge, rounding_tolerance
from slimact.cli import main

pytest.importorskip("transformers")

# Two-bit codes for every attention tensor, one scale over all heads: far below the 8-bit floor.
BROKEN = Policy(name="broken", per_kind={"attention": {"bits": 2, "groups": 1}})


def _tiny(name):
    model = zoo.build(name, tiny=True)
    return model, zoo.example_inputs(model, 2, 16)


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_a_correct_conversion_passes_and_the_model_is_left_as_found(policy):
    model, inputs = _tiny("llama")
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    rng = torch.random.get_rng_state()
    report = slimact.check(model, inputs, policy)
    assert report.passed, str(report)
    assert report.forward_equal and report.forward_max_abs_diff <= 1e-5
    assert report.lossless == (policy == "tempo")
    assert len(report.params) == len(list(model.parameters()))
    if policy == "tempo":  # equal to float rounding, not merely close
        assert all(p.diff <= rounding_tolerance(torch.float32) * p.norm for p in report.params)
    assert "PASSED" in str(report) and "left alone by convert" in str(report)
    # The user's model: same classes, same values, no gradients, its mode, the global RNG untouched.
    assert [type(m) for m in model.modules()] == classes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert torch.equal(torch.random.get_rng_state(), rng)



def test_an_already_converted_model_is_checked_against_its_plain_self_and_left_converted():
    # check's docstring: an already converted model is reverted in its copy to give the plain run, and the
    # user's model is not changed. Converted under "int8", checked under "tempo": the lossless floor can only be
    # met if the reference run is the plain model (against the int8 model "tempo" differs by 8-bit noise).
    model, inputs = _tiny("llama")
    slimact.convert(model, "int8")
    model.eval()
    classes = [type(m) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = slimact.check(model, inputs, "tempo")
    assert report.lossless and report.passed, str(report)
    # Equal to float rounding, not merely passed (the verdict alone would also pass an int8 reference: plain's own
    # float32 gradients far from the float64 run make the converted ones count as close as plain's).
    assert all(p.diff <= rounding_tolerance(torch.float32) * p.norm for p in report.params), str(report)
    assert [type(m) for m in model.modules()] == classes  # still converted
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not model.training and all(p.grad is None for p in model.parameters())

def test_dropout_draws_agree_so_a_model_with_dropout_passes_lossless():
    model, inputs = _tiny("bert-base")  # dropout 0.1 everywhere: different draws would fail the lossless floor
    report = slimact.check(model, inputs, "tempo")
    assert report.passed, str(report)
    # BERT's key biases: zero in exact arithmetic (softmax ignores a per-row shift), judged by size.
    keys = [p for p in report.params if p.name.endswith("attention.self.key.bias")]
    assert keys and all(p.negligible and p.passed for p in keys)


def test_quantize_on_a_kind_that_packs_nothing_leaves_a_lossless_policy_judged_at_float_rounding(monkeypatch):
    # per_kind={"dropout": {"quantize": True}} converts byte for byte as without it (a dropout keeps its mask as
    # bits whatever the policy), yet it had switched check to the lossy floors, where a 1% gradient error passes.
    lossless = Policy(name="lossless", quantize=False, kinds=("dropout", "layernorm"))
    same = lossless.replace(name="same", per_kind={"dropout": {"quantize": True}, "lmloss": {"quantize": True}})
    assert not lossless.quantizes and not same.quantizes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Dropout(0.1), nn.Linear(32, 4))
    x = torch.randn(16, 32)
    bytes_ = [slimact.profile(slimact.convert(copy.deepcopy(model), p), x).activation_bytes for p in (lossless, same)]
    assert bytes_[0] == bytes_[1]
    report = slimact.check(model, x, same)
    assert report.passed and report.lossless, str(report)
    # ... and held to float rounding: a LayerNorm weight gradient 1% off now fails.
    from slimact.functional.norm import _NormFunction

    backward = _NormFunction.backward

    def off(ctx, grad_y):
        grads = list(backward(ctx, grad_y))
        grads[1] = None if grads[1] is None else grads[1] * 1.01
        return tuple(grads)

    monkeypatch.setattr(_NormFunction, "backward", staticmethod(off))
    report = slimact.check(model, x, same)
    assert not report.passed and [p.name for p in report.failures] == ["1.weight"], str(report)


def test_a_broken_policy_is_reported_with_the_parameters_it_breaks():
    model, inputs = _tiny("llama")
    report = slimact.check(model, inputs, BROKEN)
    assert not report.passed
    assert report.forward_equal  # the forward is still PyTorch's: only the saved tensors are coarse
    assert report.failures and all(p.cosine < MIN_COSINE for p in report.failures)
    assert all(".self_attn." in p.name for p in report.failures), [p.name for p in report.failures]
    assert report.worst_modules(1)[0][0].rpartition(".")[2] in {"q_proj", "k_proj", "v_proj", "o_proj"}
    text = str(report)
    assert "FAILED" in text and "FAIL: cosine" in text


def test_the_floors_tell_rounding_from_error():
    g = torch.randn(1000, dtype=torch.float64).float()
    rounding = g * (1 + 1e-6)
    wrong = g + 0.02 * g.norm() / 1000**0.5 * torch.randn(1000)  # 2% noise: cosine 0.9998
    assert _judge("w", g, rounding, 1.0, lossless=True).passed
    lossless = _judge("w", g, wrong, 1.0, lossless=True)
    assert not lossless.passed and "float rounding" in lossless.reason
    assert _judge("w", g, wrong, 1.0, lossless=False).passed  # within the lossy cosine floor
    # A zero gradient holding float noise in both runs: judged by the size of the difference, not its direction.
    noise = torch.randn(10) * 1e-9
    judged = _judge("k.bias", noise, -noise, typical=1.0, lossless=False)
    assert judged.negligible and judged.passed and judged.cosine < 0
    assert not _judge("k.bias", noise, noise + 2 * NOISE, typical=1.0, lossless=False).passed


def test_cli_exit_code_follows_the_verdict(tmp_path, capsys):
    assert main(["check", "--model", "llama", "--tiny", "--seq", "16"]) == 0
    assert "PASSED" in capsys.readouterr().out
    path = BROKEN.to_file(tmp_path / "broken.toml")
    assert main(["check", "--model", "llama", "--tiny", "--seq", "16", "--policy", str(path)]) == 1
    assert "FAILED" in capsys.readouterr().out
    # Accumulating 1-row micro-batches under "mesa": the running estimates lag (see below).
    assert main(["check", "--model", "llama", "--tiny", "--seq", "16", "--policy", "mesa", "--micro-batch", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "accumulated over 2 calls" in out and "running estimates: warmed" in out


class _BiasBeforeBatchNorm(torch.nn.Module):
    """A conv whose bias feeds a training-mode BatchNorm (exact gradient zero: BatchNorm removes the shift), with
    dropout, and many parameters of tiny gradients (the typical gradient is tiny, as SwiftFormer's is: the bias's
    float32 rounding noise is then far above NOISE of it)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(8, 4)
        self.tiny = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(3)) for _ in range(12))

    def forward(self, x):
        h = self.drop(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.head(h).pow(2).sum() + 1e-9 * sum(p.sum() for p in self.tiny)


def test_a_gradient_that_is_float_noise_in_plain_is_judged_by_size(monkeypatch):
    policy = "int8"
    import importlib

    check_module = importlib.import_module("slimact.check")  # the module: slimact.check is the function
    torch.manual_seed(0)
    model, x = _BiasBeforeBatchNorm(), torch.randn(4, 3, 12, 12) * 3
    report = slimact.check(model, x, policy, loss_fn=lambda out: out)
    bias = next(p for p in report.params if p.name == "conv.bias")
    assert report.passed, str(report)
    assert bias.negligible, bias
    # Without the float64 run (a model that cannot run in float64), the bias's noise is judged as a gradient.
    monkeypatch.setattr(check_module, "_float64_grads", lambda *a, **k: None)
    report = slimact.check(model, x, policy, loss_fn=lambda out: out)
    assert [p.name for p in report.failures] == ["conv.bias"], str(report)


class _CheckpointedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.0)  # diffusers' attention and feed-forward: nn.Dropout(p=0.0), in training

    def forward(self, x):
        return self.drop(self.bn(self.conv(x)))


class _CheckpointedBiasBeforeBatchNorm(torch.nn.Module):
    """:class:`_BiasBeforeBatchNorm` with its block under a non-reentrant activation checkpoint of the module's call,
    as diffusers' ``enable_gradient_checkpointing()`` does."""

    def __init__(self):
        super().__init__()
        self.block = _CheckpointedBlock()
        self.head = torch.nn.Linear(8, 4)
        self.tiny = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(3)) for _ in range(12))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False).mean(dim=(2, 3))
        return self.head(h).pow(2).sum() + 1e-9 * sum(p.sum() for p in self.tiny)


def test_the_float64_reference_runs_through_activation_checkpointing():
    # The recompute of a non-reentrant checkpoint runs in the backward, where the float64 run's mode was off: its
    # dropout drew as written where the forward had drawn through the mode, PyTorch's checkpoint raised ("A different
    # number of tensors was saved"), and the check had no float64 reference: the bias BatchNorm cancels, float noise
    # in both runs, was judged as a gradient and FAILED (a diffusers UNet with enable_gradient_checkpointing()).
    import torch.utils.checkpoint

    torch.manual_seed(0)
    model, x = _CheckpointedBiasBeforeBatchNorm(), torch.randn(4, 3, 12, 12) * 3
    report = slimact.check(model, x, "int8", loss_fn=lambda out: out)
    bias = next(p for p in report.params if p.name == "block.conv.bias")
    assert report.passed, str(report)
    assert bias.negligible and "float64" in report.reference, str(report)


def test_the_float64_run_draws_what_the_float32_run_drew():
    # Dropout and drop-path draws in float64 take other bits of the RNG stream: the float64 reference draws them
    # as float32 (widened), so it computes the float32 run's function, and the guard accepts it.
    from slimact.check import _Float32Draws

    torch.manual_seed(0)
    x = torch.randn(64, 32)
    state = torch.random.get_rng_state()
    a = torch.nn.functional.dropout(x, 0.3) + torch.rand(64, 1) + torch.randn_like(x)
    torch.random.set_rng_state(state)
    with _Float32Draws():
        b = torch.nn.functional.dropout(x.double(), 0.3) + torch.rand(64, 1, dtype=torch.float64) + \
            torch.randn_like(x.double())
    assert b.dtype == torch.float64
    torch.testing.assert_close(b.float(), a)


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_the_float64_run_drops_what_the_float32_run_dropped_on_a_strided_tensor(layout):
    # PyTorch fills a dropout mask in the tensor's memory order; the float64 run drew its mask contiguous, dropping
    # other elements of a channels-last map (vit-pytorch's CvT) than plain's: the reference differed from plain's by
    # far more than rounding, and check judged without it.
    from slimact.check import _Float32Draws

    torch.manual_seed(0)
    x = torch.randn(6, 4).t() if layout == "transposed" else torch.randn(2, 3, 4, 5).to(
        memory_format=torch.channels_last)
    state = torch.random.get_rng_state()
    a = torch.nn.functional.dropout(x, 0.5)
    torch.random.set_rng_state(state)
    with _Float32Draws():
        b = torch.nn.functional.dropout(x.double(), 0.5)
    torch.testing.assert_close(b.float(), a)


class _MixedBlock(torch.nn.Module):
    """A pre-norm transformer block in ``low`` with its second LayerNorm kept in ``norm`` and the casts around it
    spelled out in the code, as Hugging Face models with ``_keep_in_fp32_modules`` do (and the reverse: a bfloat16
    norm inside a float32 model)."""

    def __init__(self, low, norm, d=32, heads=4):
        super().__init__()
        self.low, self.norm, self.heads = low, norm, heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.act, self.proj = torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        self.to(low)
        self.ln2.to(norm)

    def forward(self, x):
        x = x.to(self.low)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        y = self.ln2(x.to(self.norm)).to(self.low)
        return x + self.proj(self.act(self.fc(y)))


@pytest.mark.parametrize("low,norm", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["fp32-norm-in-bf16", "bf16-norm-in-fp32"])
def test_a_mixed_precision_model_is_judged_against_float64_where_plain_itself_is_off(low, norm):
    # Plain PyTorch's mixed-dtype gradients are rounded at bfloat16's level: the lossless conversion's gradients
    # differ from them by more than float32 rounding (norm weight and bias 1e-3 to 3e-4 relative, where float32
    # rounding is 1.2e-4), while both are as close to the float64 truth (measured: 2e-3 each). The float64 copy runs
    # through the casts written in the model's code (widened), so it can be the reference.
    torch.manual_seed(0)
    model, x = _MixedBlock(low, norm), torch.randn(4, 32, 32)

    def loss_fn(out):
        return out.float().square().mean()

    report = slimact.check(model, x, "tempo", loss_fn=loss_fn)
    assert report.passed, str(report)
    judged = [p for p in report.params if p.reference == "float64"]
    assert judged and all(p.off <= 2 * p.plain_off + 1e-3 * p.norm for p in judged), str(report)
    assert "float64" in report.reference and "float64" in str(report)
    # A real error in the same model is still one: 2-bit Linear inputs.
    broken = slimact.check(model, x, Policy(name="broken", per_kind={"linear": {"bits": 2, "groups": 1}}),
                           loss_fn=loss_fn)
    assert not broken.passed and {"o.weight", "fc.weight"} <= {p.name for p in broken.failures}, str(broken)


def _micro_steps(model, batch, micro_batch):
    """One training step of ``model`` on ``batch`` (tiny Llama's dict), accumulated over calls of ``micro_batch``
    rows (all of them by default); returns the gradients."""
    model.zero_grad(set_to_none=True)
    rows = len(batch["input_ids"])
    size = micro_batch or rows
    for i in range(0, rows, size):
        call = {k: v[i:i + size] for k, v in batch.items()}
        (model(**call).loss * len(call["input_ids"]) / rows).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _training_cosine(model, batches, judged, micro_batch=None):
    """What training sees under "mesa", measured without check: a converted copy trained on ``batches`` (its running
    estimates follow them; the weights are kept, as a small learning rate nearly does), then its gradients on
    ``judged`` against plain's: the lowest cosine of those that are not negligible."""
    import copy

    from slimact._metrics import cosine

    slim = slimact.convert(copy.deepcopy(model), "mesa").train()
    for batch in batches:
        _micro_steps(slim, batch, micro_batch)
    exact = _micro_steps(copy.deepcopy(model).train(), judged, micro_batch)
    approx = _micro_steps(slim, judged, micro_batch)
    typical = torch.stack([g.norm() for g in exact.values()]).median()
    return min(cosine(exact[n], approx[n]) for n in exact if exact[n].norm() > NOISE * typical)


def _lowest(report):
    return min(p.cosine for p in report.params if not p.negligible)


@pytest.mark.parametrize("rows,micro_batch", [(2, 1), (2, None), (4, None)], ids=["1-row-calls", "2-rows", "4-rows"])
def test_check_sees_the_running_estimates_training_has(rows, micro_batch):
    # Under "mesa" each call is packed with the estimate (EMA, decay 0.9) the calls before it made. check used to
    # judge a fresh copy's first step only, whose estimates are initialised from the very tensors they pack: it
    # passed tiny Llama at cosine 0.9999 where training, accumulating 1-row micro-batches, has 0.96-0.98 (0.90-0.98
    # in the first step itself), or calling it on 2 rows at a time, 0.98-0.99. It now also judges a step after
    # warming the estimates on other batches mixed from the inputs' rows, calls split as the loop splits them.
    model = _tiny("llama")[0]
    judged = zoo.example_inputs(model, rows, 16, seed=100)
    others = [zoo.example_inputs(model, rows, 16, seed=200 + i) for i in range(8)]
    truth = _training_cosine(model, others, judged, micro_batch)
    first_step = slimact.check(model, judged, "mesa", warmup=0)  # what check judged before
    assert first_step.passed and _lowest(first_step) > 0.999, str(first_step)
    report = slimact.check(model, judged, "mesa", micro_batch=micro_batch)
    assert "running estimates: warmed by" in str(report)
    assert report.passed == (truth >= MIN_COSINE), (truth, str(report))
    # Given batches of the data, check runs what training ran: the same verdict, and no better than training's (the
    # worse of the first step and the warmed one).
    given = slimact.check(model, judged, "mesa", micro_batch=micro_batch, batches=others)
    assert given.passed == (truth >= MIN_COSINE) and _lowest(given) <= truth + 1e-3, (truth, str(given))
    if micro_batch:  # each tensor's own range: no lag to see
        assert slimact.check(model, judged, "int8", micro_batch=micro_batch).passed


def test_a_bfloat16_models_outputs_are_judged_at_bfloat16_rounding():
    # Tiny GPT-2 in bfloat16 under "tempo": slimact's LM loss computes the logits in another order of summation, and
    # they differ from plain's by bfloat16 rounding (max 0.004), which the float32 bound (1.2e-4 of their magnitude)
    # called a different forward: FAILED with every gradient within its floor.
    model = zoo.build("gpt2", tiny=True).to(torch.bfloat16)
    report = slimact.check(model, zoo.example_inputs(model, 2, 16), "tempo")
    assert report.forward_equal and report.passed, str(report)
    assert "bfloat16" in report.reference


def test_the_float64_run_widens_the_casts_in_model_code():
    from slimact.check import _Float32Draws

    x = torch.randn(3, 4, dtype=torch.float64)
    with _Float32Draws():
        casts = [x.to(torch.bfloat16), x.to("cpu", torch.float16), x.to(dtype=torch.float32), x.float(), x.half(),
                 x.bfloat16(), x.type(torch.float16), torch.arange(4).float(),
                 torch.nn.functional.softmax(x, -1, dtype=torch.float32), torch.zeros(2, dtype=torch.bfloat16)]
        kept = [x.to(torch.int64), torch.arange(4).to(torch.int32), x.bool()]
    assert all(t.dtype == torch.float64 for t in casts), [t.dtype for t in casts]
    assert [t.dtype for t in kept] == [torch.int64, torch.int32, torch.bool]
    torch.testing.assert_close(casts[0], x, rtol=0, atol=0)  # no rounding to bfloat16 on the way


class _ExpertsInBfloat16(torch.nn.Module):
    """A float32 model whose gated MLP computes in bfloat16, cast in its own code (torchtitan's MoE experts:
    ``silu(x.bfloat16() @ w1.bfloat16()) * (x.bfloat16() @ w3.bfloat16())``), its groups of rows through
    ``torch._grouped_mm`` or one matmul each."""

    def __init__(self, grouped=False):
        super().__init__()
        torch.manual_seed(0)
        self.grouped = grouped
        self.w1 = torch.nn.Parameter(torch.randn(2, 128, 64) / 8)
        self.w3 = torch.nn.Parameter(torch.randn(2, 128, 64) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(2, 64, 128) / 11)

    def _mm(self, x, w):
        w = w.bfloat16().transpose(-2, -1)
        if self.grouped:
            return torch._grouped_mm(x, w, offs=torch.tensor([40, 64], dtype=torch.int32))
        return torch.cat([x[:40] @ w[0], x[40:] @ w[1]])

    def forward(self, x):
        x = x.bfloat16()
        return self._mm(torch.nn.functional.silu(self._mm(x, self.w1)) * self._mm(x, self.w3), self.w2).float()


def _grouped_mm_on_the_cpu():
    try:
        torch._grouped_mm(torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(2, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2, 4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("grouped", [False, True], ids=["matmul", "grouped_mm"])
def test_a_float32_model_computing_in_bfloat16_is_judged_at_bfloat16_rounding(grouped):
    # torchtitan's DeepSeek-V3 under "tempo" FAILED: its experts' w1 gradients 0.2% off plain's (> 1.2e-4, float32
    # rounding), which is the in-place SiLU's stated bfloat16 error, as close to float64 as plain's. Its bfloat16
    # tensors are cast in the model's code, which parameters, inputs and outputs do not show, so the float64 run was
    # guarded at 1e-3 (no reference: its outputs differ from plain's by bfloat16 rounding); and torch._grouped_mm
    # has no float64 kernel (no reference: "the model did not run in float64").
    if grouped and not _grouped_mm_on_the_cpu():
        pytest.skip("torch._grouped_mm does not run on this CPU")
    report = slimact.check(_ExpertsInBfloat16(grouped), torch.randn(64, 64), "tempo",
                           loss_fn=lambda out: out.square().mean())
    assert report.passed and "bfloat16" in report.reference, str(report)
    assert any(p.reference == "float64" for p in report.params), str(report)


def test_a_wrong_gradient_of_a_float32_model_computing_in_bfloat16_still_fails(monkeypatch):
    # The looser guard lets the float64 run be the reference; a gradient farther from it than plain's still fails.
    activation = importlib.import_module("slimact.functional.activation")  # (the package's name is a function)
    real = activation._inplace_gradient
    monkeypatch.setattr(activation, "_inplace_gradient", lambda *args: real(*args) * 1.05)
    report = slimact.check(_ExpertsInBfloat16(), torch.randn(64, 64), "tempo", loss_fn=lambda out: out.square().mean())
    assert not report.passed and [p.name for p in report.failures] == ["w1"], str(report)
    assert report.failures[0].reference == "float64", str(report)


class _GeluMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.act, self.down = torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def test_a_step_under_autocast_is_judged_at_the_autocast_dtypes_rounding(monkeypatch):
    # Under bfloat16 autocast plain's gradients are rounded at bfloat16's level, as a bfloat16 model's: a lossless
    # conversion's were held to float32's 1.2e-4 (vit-pytorch's CvT under "tempo": norm gradients 0.026 relative from
    # plain's, as far from float64 as plain's own, 30% off it: FAILED). Now to bfloat16's (4 eps, 0.031); a gradient
    # 5% off still fails.
    from slimact.check import _autocast_dtype, _tolerance

    model = _GeluMlp()
    assert _autocast_dtype() is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _autocast_dtype() == torch.bfloat16
    assert _tolerance(torch.float32, torch.bfloat16) == rounding_tolerance(torch.bfloat16) == 4 * 2.0**-7
    assert _tolerance(torch.float32, None) == rounding_tolerance(torch.float32)
    grad = torch.randn(64, 64)
    near = grad * (1 + 0.02)  # 2% off: bfloat16 rounding under autocast, not float32's
    assert _judge("w", grad, near, 1.0, True, torch.bfloat16).passed
    assert not _judge("w", grad, near, 1.0, True).passed
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = slimact.check(model, x, "tempo")
    assert report.passed and "bfloat16" in report.reference, str(report)
    activation = importlib.import_module("slimact.functional.activation")  # (the package's name is a function)
    real = activation._inplace_gradient
    monkeypatch.setattr(activation, "_inplace_gradient", lambda *args: real(*args) * 1.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = slimact.check(model, x, "tempo")
    assert not report.passed and "up.weight" in [p.name for p in report.failures], str(report)


class _AutocastInForward(torch.nn.Module):
    """Autocast entered in the model's own forward, as accelerate's mixed precision wraps ``forward``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


def test_autocast_entered_in_the_models_forward_is_seen_as_the_steps_compute_dtype(monkeypatch):
    # diffusers' UNet3D under accelerate-style bf16 autocast and "tempo": norm biases 0.35 relative from plain's,
    # 0.03x plain's distance from float64, judged at float32's 1.2e-4 (check was not called under autocast): FAILED.
    check_mod = importlib.import_module("slimact.check")
    tolerances = []
    real = check_mod._tolerance
    monkeypatch.setattr(check_mod, "_tolerance", lambda dtype, compute: tolerances.append(compute) or real(dtype,
                                                                                                         compute))
    report = slimact.check(_AutocastInForward(_GeluMlp()), torch.randn(32, 64), "tempo")
    assert report.passed and "bfloat16" in report.reference, str(report)
    assert tolerances and set(tolerances) == {torch.bfloat16}


def test_a_nan_gradient_of_plains_leaves_the_other_parameters_judged():
    # PyTorch's bf16 CPU convolution can give plain a NaN weight gradient (it reads uninitialised memory); the typical
    # gradient, the median of the norms, was then NaN, every bound NaN, and a zero gradient's judgement divided by zero
    # (vit-pytorch's RegionViT under bf16 autocast and "int8": ZeroDivisionError).
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.broken = torch.nn.Parameter(torch.ones(8))
            self.unused = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            # sqrt at 0: a finite loss, and a NaN gradient (inf * 0) for `broken` alone
            return self.lin(x).sum() + (torch.sqrt(self.broken - 1) * 0).sum() + (self.unused * 0).sum()

    report = slimact.check(Model(), torch.randn(4, 8), "int8", loss_fn=lambda out: out)
    judged = {p.name: p for p in report.params}
    assert judged["unused"].passed and judged["unused"].negligible, str(report)
    assert judged["lin.weight"].passed and not judged["broken"].passed, str(report)


def test_the_float64_run_computes_grouped_mm_per_group():
    from slimact.check import _grouped_mm_wide

    if not _grouped_mm_on_the_cpu():
        pytest.skip("torch._grouped_mm does not run on this CPU")
    torch.manual_seed(0)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)  # an empty group too
    forms = [(torch.randn(10, 16), torch.randn(3, 16, 24), offs),  # rows per group, two past the last end
             (torch.randn(3, 10, 16), torch.randn(16, 8), offs),  # columns per group
             (torch.randn(10, 8), torch.randn(8, 24), offs),  # the inner dimension per group
             (torch.randn(3, 10, 16), torch.randn(3, 16, 24), None)]
    for a, b, o in forms:
        a, b = a.bfloat16(), b.bfloat16()
        if b.dim() == 3 and o is None:
            b = b.transpose(-2, -1).contiguous().transpose(-2, -1)
        want = torch._grouped_mm(a, b, offs=o).double()
        got = _grouped_mm_wide(a.double(), b.double(), offs=o)
        if a.dim() == 2 and b.dim() == 3:  # rows past the last end are unspecified in PyTorch's, zero in ours
            want, got = want[:8], got[:8]
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


class _CountsCalls(torch.nn.Module):
    """A model whose output depends on a buffer its forward updates (a call counter; an EMA codebook)."""

    seen: typing.ClassVar[list[float]] = []  # (the counter each call of any copy saw)

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        self.seen.append(float(self.calls))
        return self.fc(x).square().sum() * self.calls


def test_the_warm_up_moves_the_buffers_a_forward_updates_in_both_copies_as_training_does():
    # The warm-up's forward calls move the converted copy's buffers (a counter here; BatchNorm's statistics; a
    # VQ-VAE's EMA codebook, which the next forward reads) as training does, and the plain copy's alike: the judged
    # step is the one training reaches. They had been put back after the warm-up: a VQ-VAE was judged with its
    # initial codebook and the estimates folded from the moved one (passed at 0.9996 where training's steps ran at
    # 0.88-0.97 under "mesa").
    torch.manual_seed(0)
    _CountsCalls.seen.clear()
    report = slimact.check(_CountsCalls(), torch.randn(4, 3, 8), "mesa", loss_fn=lambda out: out)
    assert report.estimates.startswith("warmed by 8") and report.forward_equal, str(report)
    assert _CountsCalls.seen.count(9.0) == 2, _CountsCalls.seen  # (the judged step of each warmed copy)
    # With no optimizer step between the warm-up's forwards, a buffer the forward reads is not where training has it:
    # the report names the buffers that moved (BatchNorm's statistics, which a training forward does not read, not).
    assert "moved 1 buffer(s) the model's forward updates (calls)" in report.estimates, report.estimates
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    report = slimact.check(model, torch.randn(4, 8), "mesa")
    assert "moved" not in report.estimates, report.estimates


class _SizedByLengths(torch.nn.Module):
    """A model taking sequence lengths beside its frames and sizing its padding mask by the longest (torchaudio's
    Conformer, Emformer, wav2vec2)."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.ff = torch.nn.Linear(16, 16)

    def forward(self, x, lengths):
        pad = torch.arange(int(lengths.max()))[None, :] >= lengths[:, None]  # [B, T]: T must be x's
        y, _ = self.attn(x, x, x, key_padding_mask=pad, need_weights=False)
        return self.ff(y).square().mean()


def test_the_warm_up_keeps_per_row_lengths_as_given():
    # The warm-up's batches mixed the lengths with the frames ([12, 9] became [9, 9]): the model's mask no longer
    # matched its 12 frames, and check raised inside the model's code where its training runs.
    torch.manual_seed(0)
    report = slimact.check(_SizedByLengths(), (torch.randn(2, 12, 16), torch.tensor([12, 9])), "mesa",
                           loss_fn=lambda out: out)
    assert report.estimates.startswith("warmed by 8") and report.forward_equal, str(report)


class _OnlyItsTrainingInputs(torch.nn.Module):
    """gpytorch's ExactGP in training mode: it refuses any input but its training set."""

    def __init__(self, train_x):
        super().__init__()
        self.fc, self.train_x = torch.nn.Linear(8, 8), train_x

    def forward(self, x):
        if self.training and not torch.equal(x, self.train_x):
            raise RuntimeError("You must train on the training inputs!")
        return self.fc(x).square().sum()


def test_a_model_refusing_a_warm_up_batch_is_a_clear_error_naming_batches():
    # Under running estimates check warms on batches mixed from the inputs' rows: an ExactGP's own error surfaced with
    # nothing saying the batch was check's (a sweep, 2026-12-07). The error says so; batches= of the inputs checks it.
    x = torch.randn(6, 8)
    with pytest.raises(RuntimeError, match=r"raised on one \(RuntimeError: You must train on the training inputs!\): "
                                           r"pass batches="):
        slimact.check(_OnlyItsTrainingInputs(x), x, "mesa", loss_fn=lambda out: out)
    report = slimact.check(_OnlyItsTrainingInputs(x), x, "mesa", loss_fn=lambda out: out, batches=[x] * 4)
    assert report.estimates.startswith("warmed by 4"), report.estimates


class _DrawsAtFirstCall(torch.nn.Module):
    """A model that draws random numbers at its first call only, outside its state dict (as BigBird, at a length
    too short for block-sparse attention, makes a full-attention module with fresh weights at its first forward),
    then drops out: a warmed copy's dropout masks are not those of a copy at its first call."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.noise = None

    def forward(self, x):
        if self.noise is None:
            self.noise = torch.randn(8)
        return torch.nn.functional.dropout(self.fc(x) + self.noise, 0.5).square().sum()


def test_the_warmed_step_is_judged_against_a_plain_copy_warmed_the_same_way():
    # Judged against the unwarmed plain step, its forward 'differed' (BigBird under "mesa": loss 4.84 plain, 4.90
    # warmed, every gradient below the floor) where slimact computes exactly what plain does.
    torch.manual_seed(0)
    report = slimact.check(_DrawsAtFirstCall(), torch.randn(4, 3, 8), "mesa", loss_fn=lambda out: out)
    assert report.estimates.startswith("warmed by 8"), report.estimates
    assert report.forward_equal and report.passed, str(report)
    assert report.loss_converted == pytest.approx(report.loss_plain, rel=1e-6)  # the first steps, side by side


class _LayerDrop(torch.nn.Module):
    """Residual blocks skipped at random in training, the draws made by Python's ``random`` and NumPy's global
    generator (wav2vec2-style encoders draw their LayerDrop as ``np.random.random()``, SpecAugment its masks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(6))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        import random

        import numpy as np

        for i, layer in enumerate(self.layers):
            draw = random.random() if i % 2 else np.random.random()
            if not self.training or draw >= 0.5:
                x = x + layer(x)
        return self.head(x)


@pytest.mark.parametrize("policy", ["tempo", "int8", "mesa"])
def test_draws_from_python_and_numpy_generators_agree_and_are_left_as_found(policy):
    # check set only PyTorch's generators before each step: the plain and converted steps dropped other layers
    # (a different forward, every gradient far off: FAILED under every policy, 5 runs of 5), and the caller's
    # Python and NumPy generators were advanced.
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    python, numpy_state = random.getstate(), np.random.get_state()
    report = slimact.check(_LayerDrop(), torch.randn(4, 8, 16), policy)
    assert report.passed and report.forward_equal, str(report)
    assert random.getstate() == python
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]


class _WritesIntoItsInputs(torch.nn.Module):
    """A model that writes into its input tensors in place (a label remapped, the features scaled)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm, self.lin = torch.nn.Embedding(10, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x, labels):
        labels[labels == 9] = 0
        x.mul_(2)
        return self.lin(self.norm(x + self.emb(labels))).square().mean()


@pytest.mark.parametrize("policy", ["tempo", "mesa"])
def test_a_model_writing_into_its_inputs_is_given_the_same_inputs_each_step_and_the_callers_are_left(policy):
    # check handed each step the caller's tensors themselves (those needing no gradient): the converted step saw the
    # inputs the plain step had written into (x doubled twice, labels already remapped): FAILED as a different
    # forward, and the caller's batch was changed.
    x = torch.randn(4, 8, 16)
    labels = torch.randint(0, 10, (4, 8), generator=torch.Generator().manual_seed(0))
    labels[0, 0] = 9
    x0, labels0 = x.clone(), labels.clone()
    report = slimact.check(_WritesIntoItsInputs(), (x, labels), policy)
    assert report.passed and report.forward_equal, str(report)
    assert torch.equal(x, x0) and torch.equal(labels, labels0)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_gradient_off_by_a_scale_fails_the_lossy_floor(monkeypatch, factor):
    # The lossy floor was the cosine alone, which a scale leaves at 1: with every converted Linear's weight gradient
    # doubled (or halved) check PASSED tiny Llama under "int8". The norm is now held within MAX_NORM_RATIO of
    # plain's too (8-bit noise changes it by about 1%).
    from slimact.functional.linear import _LinearFunction

    g = torch.randn(1000)
    scaled = _judge("w", g, factor * g, 1.0, lossless=False)
    assert scaled.cosine > 0.9999 and not scaled.passed and "scale" in scaled.reason
    assert _judge("w", g, 1.07 * g, 1.0, lossless=False).passed  # (within MAX_NORM_RATIO, 0.141)

    model, inputs = _tiny("llama")
    assert slimact.check(model, inputs, "int8").passed
    backward = _LinearFunction.backward

    def scaled_backward(ctx, grad_y):
        grads = list(backward(ctx, grad_y))
        grads[1] = None if grads[1] is None else grads[1] * factor
        return tuple(grads)

    monkeypatch.setattr(_LinearFunction, "backward", staticmethod(scaled_backward))
    report = slimact.check(model, inputs, "int8")
    assert not report.passed, str(report)
    assert report.failures and all(p.name.endswith("proj.weight") and p.cosine > 0.99 for p in report.failures)


class _LayerScaled(torch.nn.Module):
    """Two residual MLP blocks, the second behind a layer scale of 1e-6 (ConvNeXt, CaiT, DeiT-III at
    initialisation): its gradients are 1e-6 of the first's, and genuine (plain's as exact as any other)."""

    def __init__(self, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
            for _ in range(2))
        self.scale, self.head = torch.nn.Parameter(torch.full((d,), 1e-6)), torch.nn.Linear(d, 10)

    def forward(self, x):
        x = x + self.blocks[0](x)
        return self.head(x + self.scale * self.blocks[1](x))


@pytest.mark.parametrize("edit", ["flipped", "zeroed"])
@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_a_small_but_genuine_gradient_is_held_to_the_floor_not_judged_by_size(monkeypatch, policy, edit):
    # Gradients below the noise level of the typical one were judged by size alone (a cancellation's remainder is
    # noise): the layer-scaled block's Linear weight gradients (int8) or its norm's (tempo) flipped or zeroed PASSED,
    # though Adam steps each parameter as far whatever its gradient's size. Now the float64 run tells a remainder
    # (plain off float64 too: judged by size, as before) from a small genuine gradient (held to the floor).
    from slimact.functional.linear import _LinearFunction
    from slimact.functional.norm import _NormFunction

    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))
    assert slimact.check(_LayerScaled(), x, policy).passed
    function = _LinearFunction if policy == "int8" else _NormFunction
    backward = function.backward

    def edited_backward(ctx, grad, *rest):
        out = list(backward(ctx, grad, *rest))
        if grad.abs().max() < 1e-3:  # the layer-scaled block's (the other block's output gradients are ~1e-1)
            out[1] = -out[1] if edit == "flipped" else torch.zeros_like(out[1])  # the weight's
        return tuple(out)

    monkeypatch.setattr(function, "backward", staticmethod(edited_backward))
    report = slimact.check(_LayerScaled(), x, policy)
    assert not report.passed and report.failures, str(report)
    assert all(p.name.startswith("blocks.1.") and p.reference == "float64" for p in report.failures), str(report)


@pytest.mark.parametrize("policy", ["int8", "mesa"])  # (under "tempo" the whole is off float rounding already)
def test_an_error_in_a_fused_projections_part_fails_though_the_whole_keeps_its_cosine(monkeypatch, policy):
    # GPT-2's c_attn computes q, k and v in one Conv1D: at initialisation the query part holds 0.03% of its weight
    # gradient, so with every query gradient's sign flipped the whole was at cosine 0.999 and check PASSED (found by a
    # helper's review with deliberately broken Functions). Halves and thirds of a weight along its output dim are
    # now judged too.
    from slimact.functional.attention import _ChunkedAttention, _FlashAttentionCPU

    model, inputs = _tiny("gpt2")
    assert slimact.check(model, inputs, policy).passed
    for function in (_FlashAttentionCPU, _ChunkedAttention):  # (without dropout; with it)

        def flipped_backward(ctx, *grads, backward=function.backward):
            grad_q, *rest = backward(ctx, *grads)
            return (-grad_q, *rest)

        monkeypatch.setattr(function, "backward", staticmethod(flipped_backward))
    report = slimact.check(model, inputs, policy)
    assert not report.passed, str(report)
    failed = {p.name: p for p in report.failures}
    assert "transformer.h.0.attn.c_attn.weight" in failed, str(report)
    assert failed["transformer.h.0.attn.c_attn.weight"].cosine > 0.99
    assert "in its first " in failed["transformer.h.0.attn.c_attn.weight"].reason  # (half or third: q is in both)
    assert "along dim 1" in failed["transformer.h.0.attn.c_attn.weight"].reason


class _FiLMBeforeBatchNorm(torch.nn.Module):
    """A FiLM layer ``[shift; scale] = film(cond)`` on a conditioning vector the batch shares, then a training-mode
    BatchNorm, which removes the shift: the shift half of ``film.weight``'s gradient is zero in exact arithmetic (what
    float32 leaves of a cancellation), the scale half genuine."""

    def __init__(self, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.cond, self.film = torch.nn.Parameter(torch.randn(d)), torch.nn.Linear(d, 2 * d)
        self.lin, self.bn, self.head = torch.nn.Linear(16, d), torch.nn.BatchNorm1d(d), torch.nn.Linear(d, 4)

    def forward(self, x):
        shift, scale = self.film(self.cond.expand(x.shape[0], -1)).chunk(2, -1)
        return self.head(torch.nn.functional.gelu(self.bn(self.lin(x) + shift) * (1 + scale)))


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_a_part_that_is_noise_in_plain_is_not_held_to_the_floor(policy):
    # The parts' judgement failed this correct conversion (int8: film.weight at cosine 0.99999 whole): its shift half
    # is a cancellation's remainder, noise in both runs (found by a helper's review of the change).
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))
    report = slimact.check(_FiLMBeforeBatchNorm(), x, policy, loss_fn=lambda out: torch.nn.functional.cross_entropy(
        out, y))
    assert report.passed, str(report)


class _SmallBranch(torch.nn.Module):
    """A bfloat16 model, ``big(x) + 0.02 * small(...)``, whose small branch runs a LayerNorm kept in float32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.big, self.small = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.to(torch.bfloat16)
        self.norm = torch.nn.LayerNorm(32)


class _AlphaDroppedBranch(_SmallBranch):
    """The small branch through alpha dropout."""

    def forward(self, x):
        x = x.to(torch.bfloat16)
        h = torch.nn.functional.alpha_dropout(x, 0.5, self.training)
        small = self.small(self.norm(h.float()).to(torch.bfloat16))
        return (self.big(x) + 0.02 * small).float()


def _tempo_check_with_the_norm_weight_gradient_scaled(model_cls, monkeypatch):
    """``check`` under "tempo" of ``model_cls()``: it passes as converted, then the report with the LayerNorm
    Function's weight gradient scaled by 1.3."""
    from slimact.functional.norm import _NormFunction

    x = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(0))

    def loss_fn(y):
        return y.square().mean()

    assert slimact.check(model_cls(), x, "tempo", loss_fn=loss_fn).passed
    backward = _NormFunction.backward

    def scaled_backward(ctx, *grads):
        out = list(backward(ctx, *grads))
        out[1] = out[1] * 1.3
        return tuple(out)

    monkeypatch.setattr(_NormFunction, "backward", staticmethod(scaled_backward))
    return slimact.check(model_cls(), x, "tempo", loss_fn=loss_fn)


def test_a_float64_run_that_cannot_draw_what_plain_drew_is_no_reference(monkeypatch):
    # The float64 run cannot reproduce alpha dropout's draws; its outputs stayed within bfloat16's 8 eps of plain's
    # (the dropped branch is a small part of them), so it was used: its norm weight gradient, another draw's, was
    # as far from plain's as its own size, and a norm weight gradient scaled by 1.3 then counted as "as close to
    # float64 as plain's": check PASSED it under "tempo".
    report = _tempo_check_with_the_norm_weight_gradient_scaled(_AlphaDroppedBranch, monkeypatch)
    assert not report.passed and [p.name for p in report.failures] == ["norm.weight"], str(report)
    assert "cannot draw what the plain run drew (alpha_dropout)" in report.reference


class _BranchesOnItsDtype(_SmallBranch):
    """Code that branches on a tensor's dtype in the small branch (as fp16/bf16 clamps and rescales are written):
    the float64 run takes the other branch there."""

    def forward(self, x):
        x = x.to(torch.bfloat16)
        h = self.norm(x.float())
        if h.dtype == torch.float32:
            h = h * 2.0
        return (self.big(x) + 0.02 * self.small(h.to(torch.bfloat16))).float()


def test_plain_farther_from_float64_than_rounding_grants_no_leniency(monkeypatch):
    # Under a lossless policy a parameter passed when its gradient was no farther from the float64 run's than twice
    # plain's own distance, whatever that distance: where the float64 run took another branch (outputs within the
    # guard, the branch being small) plain's norm weight gradient was 95% of its size from float64's, and one scaled
    # by 1.3 PASSED. Plain's distance now counts only up to the guard's rounding (bfloat16: 8 eps of the gradient).
    report = _tempo_check_with_the_norm_weight_gradient_scaled(_BranchesOnItsDtype, monkeypatch)
    assert not report.passed and [p.name for p in report.failures] == ["norm.weight"], str(report)
    assert "farther from float64 than rounding" in report.failures[0].reason
    # Said as such: a failure no reference could judge, not a gradient shown wrong.
    assert report.unjudged == report.failures and "not judged: 1 of those below the floor" in str(report)


@pytest.mark.parametrize("arch", ["EfficientNetModel", "MobileViTModel"])
def test_a_float32_models_cancellations_are_judged_by_plains_own_rounding(arch):
    # BatchNorm bias gradients whose exact value is (nearly) zero by the model's structure keep what float32
    # rounding leaves of a cancellation: plain's is 3% (MobileViT) to 1e9x (tiny EfficientNet, whose gradients vanish
    # with depth) away from float64's, and "tempo"'s, rounded otherwise, as far. The guard meant for a float64 run
    # that computes otherwise in a 16-bit model (plain's distance counted only up to 1e-3) failed both under "tempo"
    # (the sweep: 3 architectures). In a float32 model plain's distance is rounding, however far.
    from slimact.zoo import build_auto, projection_loss, tiny_config, tiny_inputs

    model = build_auto(arch, tiny_config(arch.removesuffix("Model").lower())).train()
    report = slimact.check(model, tiny_inputs(model, "base"), "tempo", loss_fn=projection_loss)
    assert report.passed, str(report)
    rejudged = [p for p in report.params if p.reference == "float64"]
    assert rejudged and all(p.off <= 2 * p.plain_off for p in rejudged), str(report)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_a_model_whose_plain_step_is_not_finite_gets_a_report_saying_so(bad, policy):
    # A weight plain PyTorch trains into NaN (diffusers' NucleusMoE experts are torch.empty until from_pretrained
    # fills them): check raised "atol must be greater than or equal to zero, but got nan" from the float64 run's
    # comparison with plain's outputs (its tolerance is relative to their magnitude), where plain trains (into NaN).
    # It now reports the step: failed (nothing can be judged), each gradient saying that plain's is not finite.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with torch.no_grad():
        model[2].weight[0, 0] = bad
    report = slimact.check(model, torch.randn(4, 8), policy, loss_fn=lambda out: out.square().mean())
    assert not report.passed and report.forward_equal, str(report)
    assert all("plain's gradient is not finite" in p.reason for p in report.failures), str(report)
    assert "not finite" in report.reference, report.reference


def _small_block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


@pytest.mark.parametrize("policy", ["tempo", "mesa"])
def test_a_converted_model_is_checked_as_it_was_converted(policy):
    # The default had been "int8" whatever the model: a model converted with "mesa" (whose running estimates small
    # batches fail) was judged under int8's ranges, and modules its filter_fn excluded were converted in the copy.
    x = torch.randn(4, 10, 16)
    model = slimact.convert(_small_block(), policy, filter_fn=lambda m, name: name != "2")
    report = slimact.check(model, x)
    assert report.policy == policy and report.lossless == (policy == "tempo")
    assert report.summary.skipped.get("2") == "excluded by filter_fn" and "1" in report.summary.modules
    # a module reverted after convert stays plain; a wrapper around the model and a block of it are judged as they
    # are, under the policy they were converted with
    slimact.revert(model[1])
    assert "1" not in slimact.check(model, x).summary.modules
    wrapped = slimact.check(torch.nn.Sequential(model), x)
    assert wrapped.policy == policy and wrapped.summary.skipped.get("0.2") == "excluded by filter_fn"
    assert "0.1" not in wrapped.summary.modules
    block = slimact.convert(torch.nn.Sequential(_small_block(), torch.nn.Linear(8, 8)), policy)
    inner = slimact.check(block[0], x)
    assert inner.policy == policy and inner.lossless == (policy == "tempo")
    # an explicit policy converts a reverted copy with it, the exclusions gone
    other = slimact.check(model, x, "int8")
    assert other.policy == "int8" and {"1", "2"} <= set(other.summary.modules)
    # a plain model: int8
    assert slimact.check(slimact.revert(model), x).policy == "int8"


def test_a_converted_model_with_a_filter_and_no_policy_is_converted_again_with_its_own():
    model = slimact.convert(_small_block(), "mesa")
    report = slimact.check(model, torch.randn(4, 10, 16), filter_fn=lambda m, name: name != "2")
    assert report.policy == "mesa" and report.summary.skipped.get("2") == "excluded by filter_fn"


@pytest.mark.parametrize("reparametrize", ["prune", "weight_norm", "spectral_norm"])
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_models_reparametrized_by_pre_hooks_are_checked(reparametrize, policy):
    # PyTorch cannot deepcopy the non-leaf weight these keep as an attribute (recomputed before every call):
    # check raised PyTorch's copy error on a pruned model.
    import torch.nn.utils.prune as prune

    apply = {"prune": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
             "weight_norm": torch.nn.utils.weight_norm, "spectral_norm": torch.nn.utils.spectral_norm}[reparametrize]
    model = _small_block()
    with pytest.warns(FutureWarning) if reparametrize == "weight_norm" else contextlib.nullcontext():
        apply(model[0])
        apply(model[3])
    model = slimact.convert(model, policy)
    report = slimact.check(model, torch.randn(4, 10, 16))
    assert report.passed, str(report)
    names = {p.name for p in report.params}
    assert {"0.bias", "3.bias"} <= names and any(n.startswith("0.weight_") for n in names), names
    assert not report.missing


def test_models_holding_what_pytorch_cannot_copy_are_checked_and_the_report_says_so():
    # A forward's leftovers (MONAI's DynUNet keeps its last deep-supervision outputs in a list: check raised PyTorch's
    # deepcopy error on a model mid-training), a tensor computed at construction, a staticmethod object
    # (rotary-embedding-torch's): copied detached (said in the report, by name) or shared; a view of a parameter
    # made once is made again on the copy's parameter, so its gradient flows as in the model.
    class Holds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
            self.doubled, self.wt = self.proj.weight * 2, self.proj.weight.t()
            self.outputs, self.cache, self.rule = [], {"outs": []}, staticmethod(torch.tanh)
            self.register_buffer("last", torch.zeros(4))

        def forward(self, x):
            h = self.norm(self.proj(x))
            self.outputs[:], self.cache["outs"], self.last = [h], [h.exp()], h.mean(0)
            return self.rule(h @ self.doubled.detach() @ self.wt)

    model = Holds()
    model(torch.randn(3, 4)).sum().backward()
    report = slimact.check(model, torch.randn(3, 4))
    assert report.passed, str(report)
    assert "copied detached: last, doubled, outputs[0], ..." in report.reference, report.reference
    assert model.outputs[0].grad_fn is not None  # the user's model as found
    # the view's gradient reaches the copy's weight as it reaches the model's
    from slimact.convert import _copied

    x = torch.randn(3, 4)
    twin = _copied(model)
    for m in (model, twin):
        m.zero_grad()
        m(x).square().sum().backward()
    torch.testing.assert_close(twin.proj.weight.grad, model.proj.weight.grad)


class _Memo:
    """An object of the model's own holding a forward's output (stable-baselines3's action distribution and its torch
    Categorical's logits; gpytorch's memoised LinearOperators)."""


class _HoldsInObjects(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.memo = torch.nn.Linear(8, 8), _Memo()

    def forward(self, x):
        y = torch.relu(self.proj(x))
        self.memo.dist = torch.distributions.Categorical(logits=y)  # (two objects deep)
        return y


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_a_forwards_output_held_in_objects_of_the_model_does_not_stop_summary_or_check(policy):
    # summary ran its converted step, then copied the model: the step's output, held in an object the model keeps,
    # made the copy fail on a model the user had never run (SB3's PPO and SAC policies, a gpytorch SVGP, fastai's
    # DynamicUnet through its hooks); check failed alike on any of them after a training step (a sweep, 2026-12-07).
    x = torch.randn(4, 8)
    model = slimact.convert(_HoldsInObjects(), policy)
    assert slimact.summary(model, x).coverage is not None
    model(x).sum().backward()
    report = slimact.check(model, x)
    assert report.passed, str(report)
    assert "memo.dist.logits" in report.reference, report.reference


def test_a_part_of_a_weight_whose_gradient_is_negligible_is_judged_by_size():
    # A half of a weight along its output dim is judged on its own (a fused projection's part), by cosine: TabNet's GLU
    # half holding 7.7e-12 of its weight's gradient (1e-18 in float64: rounding noise in both runs) failed "int8" at
    # cosine 0.27 where the model cannot run in float64 (a sweep, 2026-12-07). Below the negligible size it is judged
    # by size, as a whole gradient is; a part that is small but off by more than that size still fails.
    from slimact.check import NOISE, _judge

    gen = torch.Generator().manual_seed(0)
    live = torch.randn(8, 16, generator=gen)
    noise = torch.randn(8, 16, generator=gen) * 1e-9
    exact = torch.cat([live, noise])
    approx = torch.cat([live * 1.001, torch.randn(8, 16, generator=gen) * 1e-9])
    typical = exact.norm().item()
    judged = _judge("w", exact, approx, typical, lossless=False, dim=0)
    assert judged.passed and not judged.negligible, judged.reason
    wrong = torch.cat([live, torch.full((8, 16), 2 * NOISE * typical / 16)])
    judged = _judge("w", exact, wrong, typical, lossless=False, dim=0)
    assert not judged.passed and "judged by size" in judged.reason, judged.reason


def test_a_model_copy_cannot_make_is_a_clear_error():
    class Locked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.lock = __import__("threading").Lock()

        def forward(self, x):
            return self.proj(x)

    with pytest.raises(TypeError, match=r"slimact.check runs deep copies of the model, and copy.deepcopy fails"):
        slimact.check(Locked(), torch.randn(3, 4))


def test_a_model_converted_under_two_policies_and_a_block_of_routed_calls_are_judged_as_converted():
    # A review: the root's policy alone had been read (int8 over a block converted again under mesa: no warm-up,
    # passed where the block fails), and a block whose work is routed calls alone had none (re-converted with int8).
    class Scores(torch.nn.Module):  # its products and softmax are routed (the class name says attention)
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            return (x @ x.transpose(-1, -2)).softmax(-1) @ self.proj(x)

    x = torch.randn(4, 10, 16)
    model = slimact.convert(torch.nn.Sequential(_small_block(), torch.nn.Linear(8, 16), _small_block()), "int8")
    slimact.convert(model[2], "mesa")
    report = slimact.check(model, x[..., :16])
    assert report.policy == "int8/mesa" and not report.lossless and report.estimates is not None
    tempo = slimact.convert(torch.nn.Sequential(_small_block(), torch.nn.Linear(8, 16), _small_block()), "tempo")
    slimact.convert(tempo[2], "int8")
    assert not slimact.check(tempo, x).lossless  # (judged lossless, the int8 block failed rounding's floor)
    ScoresAttention = type("ScoresAttention", (Scores,), {})
    routed = slimact.convert(torch.nn.Sequential(torch.nn.Linear(16, 16), ScoresAttention()), "mesa")
    assert slimact.check(routed[1], x).policy == "mesa"


def test_checking_a_block_leaves_its_models_routing_as_found():
    # check(block) reverted each copy through the model's routing, which grew by a copy of the block and two hooks
    # a check (torch.save of the model 14 KB -> 34 KB after four).
    from slimact.nn.routing import routings_around

    class BlockAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu((self.a(x) @ x.transpose(-1, -2)).softmax(-1) @ x))

    model = slimact.convert(torch.nn.Sequential(BlockAttention(), BlockAttention()), "mesa")
    x = torch.randn(4, 8, 16)
    model(x).sum().backward()
    (routing,) = routings_around(model[0])
    before = (len(routing.excluded), len(routing.handles))
    for _ in range(2):
        slimact.check(model[0], x)
    assert (len(routing.excluded), len(routing.handles)) == before


def test_a_trained_model_is_judged_with_its_own_estimates_and_the_report_says_so():
    model = slimact.convert(_small_block(), "mesa")
    for _ in range(3):
        model(torch.randn(4, 10, 16) * 3).sum().backward()
    assert "the model's own" in slimact.check(model, torch.randn(1, 10, 16)).estimates
    assert "from the model's own" in slimact.check(model, torch.randn(4, 10, 16)).estimates


def test_views_the_copy_cannot_make_again_are_named_and_shared_views_stay_one_tensor():
    # A view of a parameter at an offset in a larger storage (vector_to_parameters lays parameters out so): rebuilt by
    # as_strided at the original offset on the copy's parameter (offset 0), it read other elements (check passed
    # with another loss than the model's); held in a list too, it was detached there unnamed.
    class Held(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.gate = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.empty(4))
            self.gate.data = torch.randn(12)[6:10]  # (at offset 6 in a larger storage)
            self.scale, self.tied = self.gate[1:3], self.proj.weight.t()
            self.factors = [self.tied]

        def forward(self, x):
            return (self.proj(x) @ self.factors[0] @ self.tied)[..., 1:3] * self.scale

    model, x = Held(), torch.randn(3, 4)
    report = slimact.check(model, x, "tempo")
    assert report.passed and "copied detached: scale" in report.reference, report.reference
    torch.testing.assert_close(report.loss_plain, model(x).sum().item())
    from slimact.convert import _copied

    twin = _copied(model)
    assert twin.factors[0] is twin.tied and twin.tied._base is twin.proj.weight


def test_sparse_inputs_and_gradients_are_checked():
    # check's warm-up mixed a sparse input's rows (aten::gather on SparseCPU) and judged a sparse gradient
    # (nn.Embedding(sparse=True)) with a cosine of strided tensors; profile read its storage.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16, sparse=True), torch.nn.Linear(16, 8))
    ids = torch.randint(0, 50, (4, 7))
    assert slimact.check(model, ids, "mesa").passed
    assert slimact.profile(model, ids).activation_bytes > 0
    sparse = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.GELU())
    features = (torch.rand(12, 32) < 0.2).float().to_sparse()
    assert slimact.check(sparse, features, "mesa").passed


class _RefusesItsStateDict(torch.nn.Linear):
    """A quantisation library's Linear that cannot load its own state dict in place (bitsandbytes' 4- and 8-bit)."""

    def _load_from_state_dict(self, *args, **kwargs):
        raise RuntimeError("Unexpected key(s) in state_dict: 'weight.absmax'")


def test_check_under_mesa_runs_on_a_model_refusing_its_own_state_dict():
    # check under "mesa" reloaded the model's state dict after its warm-up: bitsandbytes' error, where the model trains.
    torch.manual_seed(0)
    model = torch.nn.Sequential(_RefusesItsStateDict(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    before = model[1].running_mean.clone()
    x = torch.randn(8, 16)
    report = slimact.check(model, x, "mesa")
    assert report.estimates.startswith("warmed") and len(report.params) == 6, str(report)
    torch.testing.assert_close(model[1].running_mean, before, rtol=0, atol=0)


class _Float32Only(torch.nn.Module):
    def forward(self, x):
        assert x.dtype == torch.float32, f"Unsupported input dtype: {x.dtype}"  # (torchao's int8 layers)
        return x


def test_a_model_that_cannot_run_in_float64_is_judged_without_that_reference():
    # A parameter below the floor asks for a float64 reference; torchao's AssertionError there crashed check.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), _Float32Only(), torch.nn.GELU(), torch.nn.Linear(32, 4))
    two_bits = Policy(name="two-bits", per_kind={"linear": {"bits": 2, "groups": 1}})
    report = slimact.check(model, torch.randn(8, 16), two_bits)
    assert "did not run in float64 (AssertionError: Unsupported input dtype: torch.float64)" in report.reference


def test_a_linear_whose_weight_is_a_tensor_subclass_is_left_alone_with_the_reason():
    # torchao's quantised Linears keep their class: they were counted converted while each call ran F.linear.
    class Quantised(torch.Tensor):
        pass

    linear = torch.nn.Linear(8, 8)
    linear.weight = torch.nn.Parameter(linear.weight.detach().as_subclass(Quantised))
    model = slimact.convert(torch.nn.Sequential(linear, torch.nn.GELU(), torch.nn.Linear(8, 2)), "int8")
    summary = slimact.summary(model)
    assert summary.converted == {"gelu": 1, "linear": 1} and type(model[0]) is torch.nn.Linear
    assert "its weight is a tensor subclass, Quantised" in summary.skipped["0"]


def test_a_block_reverted_in_a_converted_model_is_checked_as_a_plain_model():
    # revert(model.block) leaves the model's routing hooks on the block (to keep its calls as written): check read
    # that routing's policy from them and compared a plain copy with a plain copy (a review).
    model = slimact.convert(torch.nn.Sequential(_small_block(), torch.nn.Linear(8, 8)), "mesa")
    slimact.revert(model[0])
    report = slimact.check(model[0], torch.randn(4, 10, 16))
    assert report.policy == "int8" and report.summary.converted.get("linear") == 2


def test_a_view_made_before_its_parameter_was_replaced_is_copied_as_the_model_reads_it():
    class Stale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.wt = self.proj.weight.t()
            self.proj.weight.data = torch.randn(4, 4) * 5  # (the view still reads the old storage)

        def forward(self, x):
            return self.proj(x) @ self.wt

    model, x = Stale(), torch.randn(3, 4)
    report = slimact.check(model, x, "tempo")
    torch.testing.assert_close(report.loss_plain, model(x).sum().item())
    assert "copied detached: wt" in report.reference


class _FourierMix(torch.nn.Module):
    """FEDformer's Fourier block, reduced: a complex64 weight (``dtype=torch.cfloat``) on the rfft of the tokens, and
    Autoformer's LayerNorm that subtracts the time mean after (its bias gradient is zero by structure)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.inp, self.mid, self.out = torch.nn.Linear(1, c), torch.nn.Linear(c, c), torch.nn.Linear(c, 1)
        self.w = torch.nn.Parameter(0.1 * torch.rand(c, c, 7, dtype=torch.cfloat))
        self.norm = torch.nn.LayerNorm(c)

    def forward(self, x):  # [B, T, 1], T = 12
        h = self.inp(x)
        f = torch.fft.rfft(h.transpose(1, 2), dim=-1)  # [B, C, 7]
        g = torch.zeros(f.shape, dtype=torch.cfloat)  # (a factory of model code, as FEDformer's)
        g = g + torch.einsum("bix,iox->box", f, self.w)
        h = h + torch.fft.irfft(g, n=h.size(1), dim=-1).transpose(1, 2)
        h = self.norm(torch.relu(self.mid(h)))
        return self.out(h - h.mean(dim=1, keepdim=True))


def test_a_complex_model_has_a_float64_reference():
    # Module.double() leaves complex64 parameters, and model code's torch.cfloat factories stayed complex64: the
    # float64 run failed ("expected m1 and m2 to have the same dtype"), and FEDformer's zero-by-structure LayerNorm
    # bias gradient was judged against plain's rounding under "tempo" and failed (a sweep, 2026-12-07).
    torch.manual_seed(0)
    model = _FourierMix()
    x = torch.randn(2, 12, 1).cumsum(1)
    report = slimact.check(model, x, "tempo", loss_fn=lambda y: (y * torch.linspace(-1, 1, 12)[:, None]).sum())
    assert "no float64 reference" not in report.reference, report.reference
    assert report.passed, str(report)


class _GraphPool(torch.nn.Module):
    """Nodes to per-graph means by PyTorch Geometric's ``batch`` vector, which aggregations need sorted."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, batch):  # x [N, 8], batch [N]: the graph of each node, sorted
        if not bool((batch[1:] >= batch[:-1]).all()):
            raise ValueError("the 'index' tensor is not sorted")
        h = torch.relu(self.lin(x))
        pooled = torch.zeros(2, 16).index_add(0, batch, h) / torch.bincount(batch, minlength=2)[:, None]
        return self.head(pooled)


def test_the_warm_up_keeps_a_graph_batch_vector_as_given():
    # check's warm-up mixed every [rows] tensor element-wise: PyG's batch vector assigned nodes to random graphs,
    # and aggregations that need it sorted (SetTransformerAggregation) raised under "mesa" where training runs.
    torch.manual_seed(0)
    x, batch = torch.randn(20, 8), torch.tensor([0] * 12 + [1] * 8)
    report = slimact.check(_GraphPool(), (x, batch), "mesa", loss_fn=lambda y: y.square().sum())
    assert report.forward_equal, str(report)


def test_a_backward_alone_not_finite_is_said_so():
    # A finite loss whose backward is NaN (sqrt at 0; neuralforecast's StemGNN): the float64 run's verdict replaced
    # the "plain's gradient is not finite" reason, and the reference said nothing of it.
    class _SqrtAtZero(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.sqrt(self.a(x) * 0) + x)

    report = slimact.check(_SqrtAtZero(), torch.randn(3, 4), "int8", loss_fn=lambda y: y.square().sum())
    assert not report.passed and "plain's gradient is not finite for 2 parameter(s)" in report.reference, str(report)
    assert all("plain's gradient is not finite" in p.reason for p in report.failures), str(report)


class _SmallSideBranch(torch.nn.Module):
    """A main path, and a branch behind a layer scale of 1e-6 reading one token far smaller than the others (the row
    limit of quant.md: its weight gradient is at cosine ~0.6 under "int8"), whose input is normalised by a running
    mean its forward updates (an EMA normaliser)."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.Linear(c, c), torch.nn.GELU(), torch.nn.Linear(c, c))
        self.side = torch.nn.Linear(c, c)
        self.gamma = torch.nn.Parameter(torch.full((c,), 1e-6))
        self.register_buffer("side_mean", torch.zeros(c))

    def forward(self, x):
        xs = x + 5.0
        with torch.no_grad():
            self.side_mean.mul_(0.5).add_(0.5 * xs.mean((0, 1)))
        xs = xs - self.side_mean
        z = torch.cat([xs[:, :1] * 2e-3, xs[:, 1:]], 1)
        return self.main(x) + self.gamma * self.side(z)[:, :1]


def test_the_float64_reference_starts_from_the_buffers_the_plain_step_found():
    # The float64 copy was made of the plain model after its step: the EMA it reads had moved, plain's own gradient
    # looked "off float64" by that, and a converted side.weight at cosine 0.62 passed within twice that distance
    # (a review, 2026-12-07).
    torch.manual_seed(0)
    report = slimact.check(_SmallSideBranch(), torch.randn(2, 8, 32), "int8")
    assert not report.passed, str(report)
    assert "side.weight" in {p.name for p in report.failures}, str(report)


class _Float32Kernel(torch.autograd.Function):
    """A kernel with a float32 implementation alone (a fused or Triton kernel): no float64 run of the model."""

    @staticmethod
    def forward(ctx, x):
        if x.dtype != torch.float32:
            raise TypeError("kernel supports float32 only")
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g


def test_a_gradient_passed_by_size_with_no_float64_reference_is_named():
    # Without a float64 run, a small gradient off plain's beyond the floor passes by size: rounding (a cancellation)
    # or a genuine small gradient (here side.weight at cosine ~0.6) cannot be told apart. The report says which.
    class _Model(_SmallSideBranch):
        def forward(self, x):
            return _Float32Kernel.apply(super().forward(x))

    torch.manual_seed(0)
    report = slimact.check(_Model(), torch.randn(2, 8, 32), "int8")
    assert "passed by size alone" in report.reference and "side.weight" in report.reference, report.reference


def test_check_judges_attention_of_rows_masked_by_a_finite_fill_against_the_math_kernel():
    # A row masked whole by finfo.min: PyTorch's CPU flash backward rebuilds its probabilities as 1 instead of 1/S, in
    # float64 too, so a float64 reference running that kernel sided with plain, and check failed a right "tempo"
    # (slimact's chunked path differentiates the forward it computed: docs/attention.md).
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x):  # [B, T, 16]
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)  # [B, 2, T, 8] each
            keep = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
            keep[0, :, 2] = False  # one query row sees no key
            mask = torch.zeros(B, 1, T, T).masked_fill(~keep, torch.finfo(torch.float32).min)
            return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, 16))

    torch.manual_seed(0)
    report = slimact.check(Masked(), torch.randn(2, 5, 16), "tempo", loss_fn=lambda y: y.square().mean())
    assert report.passed, str(report)
    qkv = next(p for p in report.params if p.name == "qkv.weight")
    assert qkv.reference == "float64" and qkv.cosine < 0.99  # plain's own gradient is the one off
