"""slimact's per-model state: saved and restored with a checkpoint, never shared between models or threads,
and the same in every process."""

import contextlib
import copy
import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import slimact
from _harness import estimates


def _plain(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(),
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), nn.Linear(32, 16),
    )


def _batches(seed: int, n: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 8, 16, generator=gen) for _ in range(n)]


def _steps(model: nn.Module, opt: torch.optim.Optimizer, batches, before_step=None) -> list[torch.Tensor]:
    losses = []
    for x in batches:
        if before_step is not None:
            before_step()
        out = model(**x) if isinstance(x, dict) else model(x)
        loss = out.loss if isinstance(x, dict) else out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _assert_resume_is_exact(build, batches) -> dict[str, torch.Tensor]:
    """Steps ``batches[half:]`` of a run resumed from a checkpoint taken half-way give exactly the losses of
    the uninterrupted run; returns the estimates saved."""
    half = len(batches) // 2
    model = slimact.convert(build(0), "mesa")
    torch.manual_seed(1)
    full = _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches)

    model = slimact.convert(build(0), "mesa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    first = _steps(model, opt, batches[:half])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "slimact": slimact.state_dict(model),
                "rng": torch.get_rng_state()}, buffer)
    saved = estimates(model)
    del model, opt

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model = slimact.convert(build(5), "mesa")  # other weights, no estimates yet: all comes from the checkpoint
    model.load_state_dict(checkpoint["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(checkpoint["opt"])
    slimact.load_state_dict(model, checkpoint["slimact"])  # before the first forward: the buffers are created
    loaded = estimates(model)
    assert loaded.keys() == saved.keys()
    for key, t in saved.items():
        torch.testing.assert_close(loaded[key], t, rtol=0, atol=0)
    torch.set_rng_state(checkpoint["rng"])
    rest = _steps(model, opt, batches[half:])
    torch.testing.assert_close(torch.stack(first + rest), torch.stack(full), rtol=0, atol=0)
    return saved


def test_resume_from_a_checkpoint_gives_the_uninterrupted_losses_exactly():
    assert slimact.convert(_plain(), "mesa").state_dict().keys() == _plain().state_dict().keys()
    saved = _assert_resume_is_exact(_plain, _batches(1))
    # running estimates of the Linears, the LayerNorms and the attention (the GELU shares its input's pack)
    expected = {"0._slimact_x_lo", "1._slimact_x_range", "3.linear2._slimact_x_lo", "3.self_attn._slimact_q_lo"}
    assert expected <= saved.keys()


def test_resume_of_a_hugging_face_model_with_dropout_is_exact():
    pytest.importorskip("transformers")
    from _harness import tiny_hf

    def build(seed):
        torch.manual_seed(seed)
        return tiny_hf("gpt2")[0].train()

    inputs = tiny_hf("gpt2")[1]
    plain_keys = build(0).state_dict().keys()
    saved = _assert_resume_is_exact(build, [inputs] * 4)
    assert "transformer.h.0.attn._slimact_q_lo" in saved  # the tagged attention module's estimates
    assert slimact.convert(build(0), "mesa").state_dict().keys() == plain_keys


def test_state_dict_round_trip_strictness_and_device():
    model = slimact.convert(_plain(), "mesa")
    _steps(model, torch.optim.SGD(model.parameters(), lr=1e-2), _batches(2, 2))
    state = slimact.state_dict(model)
    assert state["step"] == 2 and state["estimates"]
    other = slimact.convert(_plain(), "mesa")
    result = slimact.load_state_dict(other, state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert slimact.state_dict(other)["step"] == 2
    for key, t in slimact.state_dict(other)["estimates"].items():
        assert torch.equal(t, state["estimates"][key]) and t.device == torch.device("cpu")
    # The saved tensors are copies: training on does not change a state taken before.
    before = {k: t.clone() for k, t in state["estimates"].items()}
    _steps(other, torch.optim.SGD(other.parameters(), lr=1e-2), _batches(3, 1))
    assert all(torch.equal(before[k], t) for k, t in state["estimates"].items())
    # A module the model does not have: an error naming it (strict), skipped and reported otherwise.
    bad = {**state, "estimates": {**state["estimates"], "9._slimact_x_lo": torch.zeros(1)}}
    with pytest.raises(KeyError, match=r"9\._slimact_x_lo"):
        slimact.load_state_dict(other, bad)
    assert slimact.load_state_dict(other, bad, strict=False).unexpected_keys == ["9._slimact_x_lo"]
    # Estimates the model has and the state lacks are dropped (they start again from the next tensor, as
    # they had at the time the state was taken), and reported as missing.
    fresh = slimact.state_dict(slimact.convert(_plain(), "mesa"))
    assert fresh["estimates"] == {}
    dropped = slimact.load_state_dict(other, fresh)
    assert sorted(dropped.missing_keys) == sorted(state["estimates"]) and not estimates(other)
    # Loaded tensors go to the module's device (on the CPU, a model moved to the "meta" device shows it).
    on_meta = slimact.convert(_plain(), "mesa").to("meta")
    slimact.load_state_dict(on_meta, state)
    assert {t.device.type for t in estimates(on_meta).values()} == {"meta"}
    assert estimates(on_meta).keys() == state["estimates"].keys()
    # A state whose tensors hold no values is refused.
    meta = {**state, "estimates": {k: torch.empty_like(t, device="meta") for k, t in state["estimates"].items()}}
    with pytest.raises(ValueError, match="meta"):
        slimact.load_state_dict(other, meta)
    with pytest.raises(ValueError, match="not converted"):
        slimact.state_dict(_plain())
    with pytest.raises(ValueError, match="step"):
        slimact.load_state_dict(other, {**state, "step": -1})


@pytest.mark.parametrize("policy", ["mesa", "int8"])
def test_a_state_of_a_trained_step_without_estimates_warns_under_running_estimates(policy):
    # torch.distributed.checkpoint fills only the keys of the dict it loads into: slimact.state_dict of a model that
    # has not trained holds no estimate, so a resumed "mesa" run restored its step and started its estimates afresh,
    # silently (its parameters 0.014 off the uninterrupted run's; a sweep, 2026-12-07).
    import warnings

    model = slimact.convert(_plain(), policy)
    _steps(model, torch.optim.SGD(model.parameters(), lr=1e-2), _batches(2, 2))
    state = slimact.state_dict(model)
    target = slimact.state_dict(slimact.convert(_plain(), policy))  # what a loader fills in place
    filled = {**target, "step": state["step"], "estimates": {k: state["estimates"][k] for k in target["estimates"]}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        slimact.load_state_dict(slimact.convert(_plain(), policy), filled)
        slimact.load_state_dict(slimact.convert(_plain(), policy), state)  # (the whole state: nothing to say)
    ours = [str(w.message) for w in seen if "holds no running estimates" in str(w.message)]
    assert len(ours) == (1 if policy == "mesa" else 0), ours


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a device besides the CPU)")
def test_loaded_state_goes_to_the_modules_device():
    model = slimact.convert(_plain(), "mesa")
    _steps(model, torch.optim.SGD(model.parameters(), lr=1e-2), _batches(2, 1))
    other = slimact.convert(_plain(), "mesa").cuda()
    slimact.load_state_dict(other, slimact.state_dict(model))
    assert all(t.is_cuda for t in estimates(other).values())
    other(torch.randn(2, 8, 16, device="cuda")).sum().backward()


def _wait(barrier: threading.Barrier) -> None:
    barrier.wait()  # (a pre-hook returning a value would replace the module's inputs)


def test_two_models_trained_in_two_threads_give_the_sequential_losses():
    def run(seed: int, barrier: threading.Barrier | None = None) -> list[torch.Tensor]:
        model = copy.deepcopy(models[seed])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if barrier is not None:
            # Both forwards are then under way at once (their seed streams begun) before either quantises.
            model[0].register_forward_pre_hook(lambda *_: _wait(barrier))
        return _steps(model, opt, _batches(seed), None if barrier is None else lambda: _wait(barrier))

    models = {seed: slimact.convert(_plain(seed), "mesa") for seed in (0, 1)}
    sequential = {seed: run(seed) for seed in (0, 1)}
    barrier = threading.Barrier(2, timeout=60)
    threaded: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            threaded[seed] = run(seed, barrier)
        except BaseException as e:  # reported below, with the other thread released
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed in (0, 1):
        torch.testing.assert_close(torch.stack(threaded[seed]), torch.stack(sequential[seed]), rtol=0, atol=0)


def test_one_model_trained_in_two_threads_at_once_is_a_clear_error_and_one_after_the_other_trains():
    # torch.nn.DataParallel's replicas share the converted model's hooks, and hogwild threads its modules: the
    # routing's state of a training forward (its mode, its module stacks) was one for both threads, which popped each
    # other's modes ("trying to pop from empty mode stack"), left calls unrouted or aborted the process (a review).
    model = slimact.convert(_plain(0), "int8")
    first_in, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(*_) -> None:  # (the first thread's forward under way until the other's has begun)
        if threading.current_thread() is threads[0]:
            first_in.set()
            release.wait(timeout=60)

    def worker(first: bool) -> None:
        try:
            if not first:
                first_in.wait(timeout=60)
            try:
                model(torch.randn(2, 8, 16)).sum().backward()
            finally:
                release.set() if not first else None
        except BaseException as e:
            errors.append(e)

    handle = model[0].register_forward_pre_hook(hold)
    threads = [threading.Thread(target=worker, args=(first,)) for first in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handle.remove()
    assert len(errors) == 1 and "already running in another thread" in str(errors[0]), errors
    # One thread after the other: each trains (the model is no thread's between its training forwards).
    other = threading.Thread(target=lambda: model(torch.randn(2, 8, 16)).sum().backward())
    other.start()
    other.join()
    model(torch.randn(2, 8, 16)).sum().backward()

    # A thread that dies inside a training forward (a KeyboardInterrupt skips the hooks that release the model) holds
    # it no more: every later training call was refused (a review).
    def interrupted(*_) -> None:
        raise KeyboardInterrupt

    handle = model[0].register_forward_pre_hook(interrupted)
    dying = threading.Thread(target=lambda: model(torch.randn(2, 8, 16)))
    dying.start()
    dying.join()
    handle.remove()
    model(torch.randn(2, 8, 16)).sum().backward()


_CROSS_PROCESS = """
import torch, slimact
from torch import nn
from slimact.quant import reference
print(hash(b"slimact"))  # this process's salt
torch.manual_seed(0)
reference.begin_stream(3)
seeds = [reference.draw_seed() for _ in range(4)]
reference.end_stream()
torch.manual_seed(0)
fallback = [reference.draw_seed() for _ in range(2)]
model = slimact.convert(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), "mesa")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(3):
    loss = model(torch.randn(4, 16)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item().hex())
print(seeds, fallback, losses)
"""


def test_stochastic_rounding_is_the_same_in_every_process():
    # The same run here and in a process with another hash seed (PYTHONHASHSEED salts hash() of bytes).
    src = str(Path(slimact.__file__).parents[1])
    other = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = {**os.environ, "PYTHONHASHSEED": other, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CROSS_PROCESS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    here = io.StringIO()
    with torch.random.fork_rng(), contextlib.redirect_stdout(here):
        exec(_CROSS_PROCESS, {})
    salt_there, result_there = proc.stdout.splitlines()
    salt_here, result_here = here.getvalue().splitlines()
    assert salt_there != salt_here  # the two processes do hash bytes differently
    assert result_there == result_here
