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
