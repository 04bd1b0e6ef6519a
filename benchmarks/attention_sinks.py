"""Attention with sinks (gpt-oss): bytes kept for the backward, plain, converted with the attention left as written
(the policy without its ``attention`` kind: what ``convert`` did before it took attention sinks), and converted. A
gpt-oss of GPT-2-small widths (768 wide, 12 query heads over 4 key/value heads of 64, 4 layers alternating sliding
windows of 128 and full attention, 4 experts of which 2 per token, vocabulary 50257), a batch of 2 x ``SEQ`` tokens
with the first row right-padded by 64, fp32, on the CPU. Writes ``benchmarks/results/attention_sinks.csv`` and ``.md``
(docs/attention.md, "Attention sinks"). Run: ``OMP_NUM_THREADS=2 python benchmarks/attention_sinks.py``.
"""

import copy

import torch

import slimact
from experts import gpt_oss  # (benchmarks/experts.py: the same model)
from slimact.bench import environment, write_results
from slimact.policy import resolve

SEQ = (1024, 2048)


def batch(seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 50257, (2, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, -64:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    plain = gpt_oss()
    rows = []
    for seq in SEQ:
        inputs = batch(seq)
        base = slimact.profile(plain, inputs)
        for policy in ("int8", "tempo"):
            full = resolve(policy)
            without = full.replace(kinds=tuple(k for k in full.kinds if k != "attention"))
            for label, pol in (("attention as written", without), ("converted", full)):
                model = slimact.convert(copy.deepcopy(plain), pol)
                report = slimact.profile(model, inputs)
                attention = sum(e.nbytes for e in report.entries if e.module.endswith("self_attn"))
                rows.append({
                    "model": "gpt-oss (4 layers, 768 wide)", "tokens": f"2 x {seq}", "policy": policy,
                    "attention": label, "plain_kept_mib": round(base.kept_bytes / 2**20, 2),
                    "kept_mib": round(report.kept_bytes / 2**20, 2),
                    "kept_ratio": round(report.kept_bytes / base.kept_bytes, 4),
                    "attention_mib": round(attention / 2**20, 2), **environment("cpu"),
                })
                print(rows[-1])
    write_results(rows, "attention_sinks")


if __name__ == "__main__":
    main()
