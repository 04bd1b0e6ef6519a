"""Run by ``torchrun --nproc-per-node 2`` from tests/test_distributed.py (CPU, gloo).

Trains the zoo's tiny Llama (no dropout, so every rank and the single-process reference draw nothing) for a
few SGD steps on this rank's half of a fixed global batch, converted with each policy, under DDP and under
FSDP2's ``fully_shard``; rank 0 writes the losses (averaged over ranks) and the final parameters.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import slimact
from slimact import zoo

STEPS = 3
GLOBAL_BATCH = 4
LR = 0.5


def batch() -> dict[str, torch.Tensor]:
    return zoo.example_inputs(zoo.build("llama", tiny=True), GLOBAL_BATCH, 32, seed=7)


def train(model: torch.nn.Module, inputs: dict[str, torch.Tensor], steps: int = STEPS) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = p.detach().clone()
    return out


class _Block(torch.nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = (torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                                   torch.nn.Linear(4 * d, d))

    def forward(self, x):  # [B, T, d]
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def tp_block() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Block().train()


def tp_case(block: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    return block, torch.randn(2, 8, 32)


def tp_step(block: torch.nn.Module, x: torch.Tensor, plan: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    """One step of ``block`` under tensor parallelism (``"tp"``: fc1 column-wise, fc2 row-wise) or with sequence
    parallelism too (``"sp"``: the norm's tokens sharded), on this rank: the output (all of it) and fc1's and the
    norm's weight gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    if plan == "sp":
        layout = {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                  "fc2": RowwiseParallel(output_layouts=Shard(1))}
        part = x.shape[1] // world
        x = x[:, rank * part:(rank + 1) * part]
    else:
        layout = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    parallelize_module(block, mesh, layout)
    out = block(x.contiguous())
    out.square().sum().backward()
    if plan == "sp":
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.detach().contiguous())
        out = torch.cat(parts, dim=1)
    full = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in block.named_parameters() if n in ("fc1.weight", "norm.weight")}
    return {"out": out.detach(), **{n: g.detach() for n, g in full.items()}}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    share = GLOBAL_BATCH // world
    local = {k: v[rank * share:(rank + 1) * share] for k, v in batch().items()}
    results = {}
    for policy in ("tempo", "int8"):
        for mode in ("ddp", "fsdp2"):
            model = slimact.convert(zoo.build("llama", tiny=True).train(), policy)
            if mode == "ddp":
                wrapped = DistributedDataParallel(model)
            else:
                for layer in model.model.layers:
                    fully_shard(layer)
                wrapped = fully_shard(model)
            losses = torch.stack(train(wrapped, local))
            dist.all_reduce(losses)
            # Modules sent back to their own code by the wrapper (fully_shard sets attributes on every module).
            fell_back = [n for n, m in model.named_modules()
                         if isinstance(m, slimact.nn.SlimModule) and not m._slimact_as_probed()]
            # (every rank profiles: the step's collectives need them all; FSDP2's gradients are DTensors)
            kept = slimact.profile(wrapped, local).activation_bytes
            results[(policy, mode)] = {"losses": (losses / world).tolist(), "params": full_state(wrapped),
                                       "fell_back": fell_back, "kept": kept}
    # Tensor parallelism (and sequence parallelism) over a model converted first: DTensor activations run as written
    # (an 8-bit pack read a DTensor's storage, "invalid python storage"; "tempo"'s norm, "Replicate to
    # Partial(product)"), the rest as converted.
    for policy in ("tempo", "int8"):
        for plan in ("tp", "sp"):
            torch.manual_seed(0)
            block = slimact.convert(tp_block(), policy)
            _, x = tp_case(block)
            results[(policy, plan)] = tp_step(block, x, plan, rank, world)
    # Sharded first, then converted: a clear error, not a crash inside a probe.
    sharded = zoo.build("llama", tiny=True).train()
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    try:
        slimact.convert(sharded)
        results["convert after fully_shard"] = "converted"
    except Exception as e:  # (what was raised is the result)
        results["convert after fully_shard"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Gloo's and DDP's C++ threads can still be joinable while the interpreter finalises, which aborts the rank
    # ("terminate called without an active exception", exit -6) after its work is done and written; the results are
    # on disk and the group is destroyed, so leave without running the finalisers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
