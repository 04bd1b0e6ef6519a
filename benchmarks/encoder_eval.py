"""Inference of a converted ``nn.TransformerEncoder`` against plain (benchmarks/results/encoder_eval.{csv,md}).

A converted ``nn.TransformerEncoderLayer`` takes PyTorch's fused inference kernel where the plain layer does
(``torch._transformer_encoder_layer_fwd``; ``slimact.nn.routing``'s ``_Unhooked``). The third setup refuses that kernel
as slimact's own hooks did before (a no-op forward hook of the user's on each layer: the module-by-module path), so
the file shows what the kernel is worth and that the converted model's output is plain's bit for bit. 6 layers of
width 512 (8 heads, FFN 2048), 8 x 256 tokens, and 2 layers of width 64 (4 heads), 16 x 32 tokens; fp32,
``inference_mode``; without a mask, and with half the rows padded to half their length (the encoder's nested-tensor
path). Time ratios to plain's, interleaved, 15 rounds.

    python benchmarks/encoder_eval.py
"""

import copy

import torch
from torch import nn

import slimact
from slimact.bench import _interleaved, _ratios, environment, write_results


def main(rounds: int = 15) -> None:
    rows = []
    for layers, width, heads, batch, tokens in ((6, 512, 8, 8, 256), (2, 64, 4, 16, 32)):
        rows += _rows(layers, width, heads, batch, tokens, rounds)
    print("wrote", write_results(rows, "encoder_eval"))


def _rows(layers: int, width: int, heads: int, batch: int, tokens: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True)
    plain = nn.TransformerEncoder(layer, layers, enable_nested_tensor=True).eval()
    slim = slimact.convert(copy.deepcopy(plain), "int8").eval()
    refused = copy.deepcopy(slim)
    for block in refused.layers:
        block.register_forward_hook(lambda *args: None)  # (the fused kernel refused: the module-by-module path)
    x = torch.randn(batch, tokens, width)
    pad = torch.zeros(batch, tokens, dtype=torch.bool)
    pad[::2, tokens // 2:] = True
    rows = []
    for mask, kwargs in (("none", {}), ("padding", {"src_key_padding_mask": pad})):
        setups = {"plain": plain, "int8": slim, "int8, fused kernel refused": refused}
        with torch.inference_mode():
            outputs = {name: model(x, **kwargs) for name, model in setups.items()}
            times = _interleaved({name: (lambda m=model, kw=kwargs: m(x, **kw)) for name, model in setups.items()},
                                 rounds)
        for name in setups:
            diff = (outputs[name] - outputs["plain"]).abs().max().item()
            rows.append({"setup": name, "mask": mask, "layers": layers, "width": width, "batch": batch,
                         "tokens": tokens, **_ratios(times[name], times["plain"]), "max_abs_diff_to_plain": diff,
                         **environment()})
            print(layers, width, name, mask, rows[-1]["time_ratio_median"], diff, flush=True)
    return rows


if __name__ == "__main__":
    main()
