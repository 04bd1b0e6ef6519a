#!/usr/bin/env bash
# The GPU checks and benchmarks of the speed work, for a machine with a CUDA device; under 8 minutes (the
# timeouts below add up to 7.8, not yet run on a GPU). Writes its results under benchmarks/results/gpu/ (or the folder given): commit them.
#
#   bash benchmarks/gpu.sh [out-folder]
#
# 1. The Triton kernels against the reference, bit for bit, on the device (tests/quant/test_triton.py runs
#    there when CUDA is available; on CPU the suite runs it under TRITON_INTERPRET=1).
# 2. Pack and unpack of a 64 MiB fp32 tensor against the device's Tensor.copy_ (and clone), and each Function's
#    forward + backward against PyTorch's (slimact bench --ops).
# 3. A bf16 training step of GPT-2 (12 layers) at batch 8 x 1024, plain against "int8", "tempo" and per-layer
#    checkpointing, interleaved (slimact bench --speed), with activation bytes and the step's peak.
# 4. The same model at one memory budget (slimact bench --throughput): each setup at the largest batch measured
#    to fit 24 GiB (slimact fit), samples per second against plain's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python}; fi
OUT=${1:-benchmarks/results/gpu}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    | tee "$OUT/device.txt"
timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/quant/test_triton.py tests/test_kinds.py::test_probes_recognise_a_model_moved_to_cuda_before_convert 2>&1 | tail -5 | tee "$OUT/triton_tests.txt"
timeout 60 "$PY" -m slimact bench --ops --device cuda --out "$OUT" --name ops
timeout 210 "$PY" -m slimact bench --speed --device cuda --models gpt2 --layers 12 --batch 8 --seq 1024 \
    --dtypes bf16 --rounds 7 --policies tempo int8 checkpoint --out "$OUT" --name speed
timeout 110 "$PY" -m slimact bench --throughput --device cuda --models gpt2 --layers 12 --seq 1024 --dtypes bf16 \
    --budget 24GiB --max-batch 64 --rounds 5 --policies int8 tempo --out "$OUT" --name throughput
