"""Mesa's per-call-site running estimates under training loops that call a converted model otherwise than
``model(x)`` once per step (docs/mesa.md, "Call sites and steps").

Each pattern trains a plain model and a converted copy (same weights each step, SGD on the plain one), 20 steps of
fresh batches, and prints the worst gradient cosine and SQNR against plain (parameters and the input) in the first
step and over steps 5-19, how far the estimates a pack found were from its tensor's own range (out: beyond the
estimate, in ranges; est/own: the estimate's range over the tensor's), and the running estimates held after steps 1,
5 and 20. Run: ``OMP_NUM_THREADS=1 python benchmarks/mesa_call_sites.py [p0 p1 ... p7]`` (default: all).
"""

import copy
import math
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimact
from slimact._metrics import cosine, sqnr_db
from slimact.quant.state import RunningRange

D = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * D, D)
        self.ln = nn.LayerNorm(D)

    def forward(self, h):
        return self.ln(self.fc2(self.act(self.fc1(h))))


class Net(nn.Module):
    """encoder (2 blocks) + head; forward = head(encoder(x))."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


class Shared(nn.Module):
    """ALBERT-like: one block at every depth, range growing with depth (h = 2 h + block(h))."""

    def __init__(self, depth=6):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(D, 1)
        self.depth = depth

    def forward(self, x, depth=None):
        h = x
        for _ in range(self.depth if depth is None else depth):
            h = 2 * h + self.block(h)
        return self.head(h)


INPUTS = []


def batch(step, n=4):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 16, D, generator=g).requires_grad_()
    INPUTS.append(x)
    return x, torch.randn(n, 16, 1, generator=g)


# Diagnostics: per pack with a running estimate, how far the estimate is from the tensor's own range.

MISFIT = []
_upd = RunningRange.update


def _update(self, lo, hi, decay, training=True):
    found = _upd(self, lo, hi, decay, training)
    elo, ehi = found
    rng = (hi - lo).float().clamp_min(1e-12)
    erng = (ehi - elo).float().clamp_min(1e-12)
    over = torch.maximum(elo - lo.float(), hi.float() - ehi).clamp_min(0) / rng  # out of the estimate, in ranges
    coarse = erng / rng
    MISFIT.append((over.max().item(), coarse.max().item()))
    return found


RunningRange.update = _update


def states(model):
    return sum(1 for n, b in model.named_buffers() if n.endswith("_lo") and "_slimact_" in n)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(name, build, loss_fn, steps=20, policy="mesa", models=1, lr=0.02, check=None, conv=None):
    torch.manual_seed(0)
    plain = build()
    plain = plain if isinstance(plain, tuple) else (plain,)
    conv_models = tuple(copy.deepcopy(m) for m in plain)
    for m in conv_models:
        (conv or (lambda m: slimact.convert(m, policy)))(m)
    opt = [torch.optim.SGD(m.parameters(), lr=lr) for m in plain]
    worst_over = worst_coarse = 0.0
    worst_first = worst_late = 1.0
    sq_late = math.inf
    counts = []
    for step in range(steps):
        res = []
        for ms in (plain, conv_models):
            for m in ms:
                m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            INPUTS.clear()
            MISFIT.clear()
            loss_fn(ms if len(ms) > 1 else ms[0], step)
            r = {f"{i}.{n}": g for i, m in enumerate(ms) for n, g in grads(m).items()}
            r.update({f"input{j}": x.grad for j, x in enumerate(INPUTS) if x.grad is not None})
            res.append(r)
        if step >= 5 and MISFIT:
            over = max(o for o, _ in MISFIT)
            coarse = max(c for _, c in MISFIT)
            worst_over = max(worst_over, over)
            worst_coarse = max(worst_coarse, coarse)
        ex, ap = res
        assert ex.keys() == ap.keys(), (ex.keys() - ap.keys(), ap.keys() - ex.keys())
        assert all(torch.isfinite(g).all() for g in ex.values()), "diverged"
        cos = min(cosine(ex[n], ap[n]) for n in ex)
        sq = min(sqnr_db(ex[n], ap[n]) for n in ex)
        if step == 0:
            worst_first = cos
            sq_first = sq
        if step >= 5:
            worst_late = min(worst_late, cos)
            sq_late = min(sq_late, sq)
        counts.append(sum(states(m) for m in conv_models))
        for o in opt:
            o.step()
        for p, c in zip(plain, conv_models, strict=False):
            c.load_state_dict(p.state_dict())
    print(
        f"{name:48s} step0 cos {worst_first:.5f} ({sq_first:5.1f} dB) | steps5-{steps - 1} min cos "
        f"{worst_late:.5f} ({sq_late:5.1f} dB) | late misfit: out {worst_over:.2f} ranges, est/own "
        f"{worst_coarse:.1f}x | states {counts[0]}->{counts[4]}->{counts[-1]}",
        flush=True,
    )
    return conv_models


mse = nn.functional.mse_loss


# --- the patterns ---

LR = 1e-5
which = sys.argv[1:] or ["all"]


def want(k):
    return "all" in which or k in which


if want("p0"):

    def f(m, s):
        x, y = batch(s)
        mse(m(x), y).backward()

    run("P0 root forward once per step", Net, f)
    run("P0 root forward once per step (int8)", Net, f, policy="int8")
if want("p1"):

    def f(m, s):
        x, y = batch(s)
        h = m.encoder(x)
        mse(m.head(h), y).backward()

    run("P1 submodules called directly", Net, f)
if want("p2"):

    def f(m, s):
        x, y = batch(s)
        mse(m(x), y).backward()

    run("P2a shared block x6, root forward", Shared, f, lr=LR)
    run("P2a shared block x6, root forward (int8)", Shared, f, policy="int8", lr=LR)

    def f(m, s):
        x, y = batch(s)
        h = x
        for _ in range(6):
            h = 2 * h + m.block(h)
        mse(m.head(h), y).backward()

    run("P2b shared block x6, loop in training script", Shared, f, lr=LR)
if want("p3"):

    def f(m, s):
        x, y = batch(s)
        d = int(torch.randint(2, 7, ()).item())
        mse(m(x, d), y).backward()

    run("P3a layer drop: random depth 2..6, root", Shared, f, lr=LR)

    def f(m, s):
        x, y = batch(s)
        h = x
        d = int(torch.randint(2, 7, ()).item())
        for _ in range(d):
            h = 2 * h + m.block(h)
        mse(m.head(h), y).backward()

    run("P3b random depth 2..6, loop in script", Shared, f, lr=LR)

    def f(m, s):
        x, y = batch(s)
        h = x
        k = 0
        while True:  # until the norm passes a data-dependent bound
            h = 2 * h + m.block(h)
            k += 1
            if h.detach().abs().mean() > 3 * x.abs().mean() * (1 + s % 3) or k >= 8:
                break
        mse(m.head(h), y).backward()

    run("P3c while loop until bound, in script", Shared, f, lr=LR)
if want("p4"):

    def f(ms, s):
        G, Dm = ms
        x, _y = batch(s)
        z = torch.randn(4, 16, D)
        fake = G.encoder(z)  # generator
        d_loss = mse(Dm(x), torch.ones(4, 16, 1)) + mse(Dm(fake.detach()), torch.zeros(4, 16, 1))
        d_loss.backward()
        g_loss = mse(Dm(fake), torch.ones(4, 16, 1))
        g_loss.backward()

    run("P4a GAN: G.encoder direct, D root x3", lambda: (Net(), Net()), f, lr=1e-3)

    def f(ms, s):
        T, S = ms
        x, _y = batch(s)
        with torch.no_grad():
            t = T(x)
        T.train()
        mse(S(x), t).backward()

    run("P4b teacher(no_grad)/student", lambda: (Net(), Net()), f)

    def f(m, s):
        x, _y = batch(s)
        v1 = x + 0.1 * torch.randn_like(x)
        v2 = x * 3 + 0.1 * torch.randn_like(x)
        a, b = m.encoder(v1), m.encoder(v2)
        (a - b).pow(2).mean().backward()

    run("P4c contrastive two views (x, 3x), direct", Net, f)

    def f(m, s):
        x, _y = batch(s)
        v1 = x + 0.1 * torch.randn_like(x)
        v2 = x * 3 + 0.1 * torch.randn_like(x)
        (m(v1) - m(v2)).pow(2).mean().backward()

    run("P4c' contrastive two views (x, 3x), root", Net, f)

    def f(m, s):
        x, _y = batch(s)
        v1 = x + 0.1 * torch.randn_like(x)
        v2 = 0.9 * x + 0.1 * torch.randn_like(x)
        (m(v1) - m(v2)).pow(2).mean().backward()

    run("P4e contrastive two views (same range), root", Net, f)

    def f(m, s):
        # first-order MAML: inner step on support, outer loss on query with fast weights (torch.func.functional_call)
        x, y = batch(s)
        xq, yq = batch(s + 500)
        params = dict(m.named_parameters())
        inner = mse(torch.func.functional_call(m, params, (x,)), y)
        g = torch.autograd.grad(inner, list(params.values()))
        fast = {n: (p - 0.1 * gi).detach().requires_grad_() for (n, p), gi in zip(params.items(), g, strict=False)}
        outer = mse(torch.func.functional_call(m, fast, (xq,)), yq)
        gf = torch.autograd.grad(outer, list(fast.values()))
        for p, gi in zip(params.values(), gf, strict=False):
            p.grad = gi

    run("P4d first-order MAML (functional_call)", Net, f)
    class Cell(nn.Module):
        """A recurrent cell: the model's forward is one time step."""

        def __init__(self):
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(D, 1)

        def forward(self, h):
            return 2 * h + self.block(h)

    def f(m, s):
        x, y = batch(s)
        h = x
        for _ in range(6):
            h = m(h)  # one forward of the converted model per time step
        mse(m.head(h), y).backward()

    run("P4f recurrent: model(h) per time step, 6/step", Cell, f, lr=LR)

    def f(m, s):
        x, y = batch(s)
        h = x
        for _ in range(6):
            h = 2 * h + m.block(h)  # the cell's block called by the loop
        mse(m.head(h), y).backward()

    run("P4g recurrent: model.block(h) per time step", Cell, f, lr=LR)
if want("p5"):

    def f(m, s):
        for k in range(4):
            x, y = batch(s * 10 + k, n=1)
            mse(m(x), y).backward()

    run("P5a accumulation 4x1 rows, root, bwd each", Net, f, lr=1e-3)

    def f(m, s):
        loss = 0
        for k in range(4):
            x, y = batch(s * 10 + k, n=1)
            loss = loss + mse(m(x), y)
        loss.backward()

    run("P5b accumulation 4x1 rows, root, one bwd", Net, f, lr=1e-3)

    def f(m, s):
        loss = 0
        for k in range(4):
            x, y = batch(s * 10 + k, n=1)
            loss = loss + mse(m.head(m.encoder(x)), y)
        loss.backward()

    run("P5c accumulation 4x1 rows, direct, one bwd", Net, f, lr=1e-3)

    def f(m, s):
        x, y = batch(s)
        m.eval()
        m(x * 100)
        m.train()
        with torch.no_grad():
            m(x * 100)
            m.encoder(x * 100)
        mse(m(x), y).backward()

    run("P5d eval + no_grad calls interleaved (root)", Net, f)

    def f(m, s):
        x, y = batch(s)
        m.eval()
        m.encoder(x * 100)
        m.train()
        with torch.no_grad():
            m.encoder(x * 100)
        h = m.encoder(x)
        with torch.no_grad():
            m.encoder(x * 100)
        mse(m.head(h), y).backward()

    run("P5e eval + no_grad calls interleaved (direct)", Net, f)
if want("p6"):

    def f(m, s):
        x, y = batch(s)
        h = checkpoint(m.encoder, x, use_reentrant=False)
        mse(m.head(h), y).backward()

    run("P6a checkpoint(encoder) direct, non-reentrant", Net, f)

    def f(m, s):
        x, y = batch(s)
        h = x
        for _ in range(6):
            h = 2 * h + checkpoint(m.block, h, use_reentrant=False)
        mse(m.head(h), y).backward()

    run("P6b checkpoint(shared block) x6 in script", Shared, f, lr=LR)

    def f(m, s):
        x, y = batch(s)
        h = x.requires_grad_()
        for _ in range(6):
            h = 2 * h + checkpoint(m.block, h, use_reentrant=True)
        mse(m.head(h), y).backward()

    run("P6c checkpoint reentrant shared block x6 script", Shared, f, lr=LR)
if want("p7"):

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    def f(m, s):
        x, y = batch(s)
        mse(m(x), y).backward()

    # converted inner, wrapper around it
    def build():
        return Wrapper(Shared())

    run(
        "P7a wrapper owning converted Shared (convert inner)",
        build,
        f,
        conv=lambda w: slimact.convert(w.inner, "mesa"),
        lr=LR,
    )
    run("P7b wrapper converted as root", build, f, lr=LR)

    def f(m, s):
        x, y = batch(s)
        mse(m(x), y).backward()

    t = time.time()

    def conv_compile(m):
        slimact.convert(m, "mesa")

    class CompiledHolder(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.fn = None

        def forward(self, x):
            if self.fn is None:
                self.fn = torch.compile(self.inner)
            return self.fn(x)

    def build():
        return CompiledHolder(Shared())

    run("P7c torch.compile(converted Shared)", build, f, conv=lambda w: slimact.convert(w.inner, "mesa"), lr=LR)
    print("compile time", time.time() - t)
