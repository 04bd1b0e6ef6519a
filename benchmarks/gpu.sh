#!/usr/bin/env bash
# The GPU checks and benchmarks, for one run of about 8 minutes on a machine with a CUDA device (the steps'
# timeouts add up to 480 s). Needs no install: runs from the checkout (PYTHONPATH=src) with $PYTHON, else
# .venv/bin/python where it exists, else python3.
#
#   bash benchmarks/gpu.sh OUTDIR
#
# Each step runs under its own `timeout`, its exit code is recorded and the next step runs whatever it was
# (no `set -e`). Each step writes its log (and its CSV/Markdown) to OUTDIR/steps/ as it goes; after each step
# everything is packed into OUTDIR/gpu-results.tar.gz and OUTDIR/summary.txt is rewritten (per step: exit code,
# seconds, last lines), so a run cut short still leaves its results; at the end OUTDIR holds those two files only.
#
#   device      (15 s)  the device, torch / triton / transformers versions, nvidia-smi.
#   kernels     (30 s)  the Triton kernels (quantize, dequantize, group_stats, quantize_stats) against the reference,
#                       [8192, 768] bf16/fp32 whole tensor and channel groups, [8, 12, 1024, 64] per head; 8-bit
#                       nearest, stochastic (seed 1234), 4-bit: mismatching codes and restored values per case
#                       (slimact bench --kernels; exit 1 on any mismatch).
#   ops         (50 s)  pack/unpack against copy_ on 64 MiB fp32: ratios; per layout (whole tensor, channel groups,
#                       per head) at 64 and 512 MiB, GB/s from CUDA-event medians (host work included) and from the
#                       kernels' own device time (torch.profiler); each Function's forward + backward against
#                       PyTorch's (slimact bench --ops).
#   speed      (160 s)  GPT-2 (12 layers, bf16, batch 8 x 1024) training step, plain vs "tempo" and "int8", with
#                       every dropout at 0 and at 0.1, 3 interleaved rounds; first_step_s (compilation included)
#                       apart from the rounds (slimact bench --speed).
#   profile     (75 s)  the same GPT-2 step (dropout 0.1) under torch.profiler, plain, tempo and int8: GPU busy time,
#                       kernel launches and host syncs per step, GPU time by kernel family and by the op that
#                       launched it, top kernels and CPU ops, each synchronizing call by its line of Python
#                       (benchmarks/gpu_profile.py, to profile.md).
#   tests       (65 s)  the CUDA tests of tests/functional/test_attention.py, tests/test_kinds.py's CUDA probe test,
#                       the launch-count and model-sized tests of tests/quant/test_triton_finish.py first, then
#                       tests/test_state.py, the rest of tests/quant/test_triton_finish.py, then tests/quant/test_triton.py (its
#                       ~560 kernel variants compile one by one: the last ones are cut; SLIMACT_GPU_TRITON_TESTS=0
#                       leaves the file out), 60 s per test where pytest-timeout is installed.
#   check       (45 s) slimact check of the zoo's tiny GPT-2 and Llama on the device, tempo and int8: one training
#                       step against plain's (forward, every parameter gradient; exit 1 below the floors).
#   throughput  (40 s)  the same GPT-2 at a 24 GiB budget, each setup at the largest batch that fits
#                       (slimact bench --throughput); the first to cut when time is short.
#
# SLIMACT_GPU_STEPS="kernels tests" runs only the steps named (and device), for a short run on a lease.
#
# Dry mode (no CUDA device, or SLIMACT_GPU_DRY=1): every step still starts; the kernel probe runs on CPU at tiny
# shapes under TRITON_INTERPRET=1; the slimact bench steps parse their arguments, write "no device" to their log
# and exit 0 (SLIMACT_GPU_DRY=1); the test step only collects its tests (tests/test_bench.py runs this mode).
cd "$(dirname "$0")/.." || exit 1
[ $# -ge 1 ] || { echo "usage: bash benchmarks/gpu.sh OUTDIR" >&2; exit 2; }
OUTDIR=$1
mkdir -p "$OUTDIR/steps" || exit 1
OUTDIR=$(cd "$OUTDIR" && pwd)
STEPS=$OUTDIR/steps
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
SUMMARY=$OUTDIR/summary.txt
RECORDS=$STEPS/.records
: >"$RECORDS"
DRY=${SLIMACT_GPU_DRY:-0}

pack_up() {
    {
        echo "benchmarks/gpu.sh on $(hostname) $(date -u +%FT%TZ); python: $PY; dry: $DRY"
        while IFS='|' read -r name rc secs; do
            printf '\n== %-10s exit %-3s %5s s\n' "$name" "$rc" "$secs"
            tail -n 6 "$STEPS/$name.log" 2>/dev/null | sed 's/^/   /'
        done <"$RECORDS"
    } >"$SUMMARY"
    cp "$SUMMARY" "$STEPS/summary.txt"
    tar -czf "$OUTDIR/gpu-results.tar.gz.part" -C "$OUTDIR" steps && mv "$OUTDIR/gpu-results.tar.gz.part" "$OUTDIR/gpu-results.tar.gz"
}

# step NAME SECONDS CUDA_ONLY COMMAND...: runs COMMAND under `timeout`, its output to steps/NAME.log.
step() {
    local name=$1 limit=$2 cuda_only=$3 rc start
    shift 3
    if [ -n "${SLIMACT_GPU_STEPS:-}" ] && [ "$name" != device ] && [[ " $SLIMACT_GPU_STEPS " != *" $name "* ]]; then
        echo "$name|not run (SLIMACT_GPU_STEPS)|0" >>"$RECORDS"
        return
    fi
    start=$(date +%s)
    echo "== $name: $*" | tee "$STEPS/$name.log"
    [ "$DRY" = 1 ] && [ "$cuda_only" = 1 ] && echo "no device (dry mode): the command starts and only checks its arguments" \
        | tee -a "$STEPS/$name.log"
    SLIMACT_GPU_DRY=$DRY timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$STEPS/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "timed out after $limit s" | tee -a "$STEPS/$name.log"
    echo "$name|$rc|$(( $(date +%s) - start ))" >>"$RECORDS"
    pack_up
}

step device 15 0 "$PY" -c "
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda)
for m in ('triton', 'transformers', 'pytest_timeout'):
    try:
        print(m, 'yes' if m == 'pytest_timeout' else '', getattr(__import__(m), '__version__', ''))
    except Exception as e:
        print(m, 'missing:', type(e).__name__, e)
print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no device')
"
if ! grep -q '^device: ' "$STEPS/device.log" || grep -q '^device: no device' "$STEPS/device.log"; then DRY=1; fi
[ "$DRY" = 1 ] || nvidia-smi >>"$STEPS/device.log" 2>&1

if [ "$DRY" = 1 ]; then
    step kernels 40 0 env TRITON_INTERPRET=1 "$PY" -m slimact bench --kernels --device cpu --tiny --out "$STEPS" --name kernels
else
    step kernels 30 0 "$PY" -m slimact bench --kernels --device cuda --out "$STEPS" --name kernels
fi
step ops 50 1 "$PY" -m slimact bench --ops --device cuda --rounds 7 --out "$STEPS" --name ops
step speed 160 1 "$PY" -m slimact bench --speed --device cuda --models gpt2 --layers 12 --batch 8 --seq 1024 \
    --dtypes bf16 --rounds 3 --policies tempo int8 --dropout 0 0.1 --out "$STEPS" --name speed
PROFILE_ARGS=()
[ "$DRY" = 1 ] && PROFILE_ARGS=(--dry)
step profile 75 1 "$PY" benchmarks/gpu_profile.py --model gpt2 --layers 12 --batch 8 --seq 1024 --dtype bf16 \
    --dropout 0.1 --setups plain tempo int8 --steps 3 --out "$STEPS/profile.md" "${PROFILE_ARGS[@]}"
TRITON_TESTS=(tests/quant/test_triton.py)
[ "${SLIMACT_GPU_TRITON_TESTS:-1}" = 0 ] && TRITON_TESTS=()
PYTEST_ARGS=()
grep -q '^pytest_timeout yes ' "$STEPS/device.log" && PYTEST_ARGS=(--timeout 60)
[ "$DRY" = 1 ] && PYTEST_ARGS+=(--collect-only)  # dry: the files collect; their CUDA tests would skip here
step tests 65 1 "$PY" -m pytest -q -p no:cacheprovider -rfE "${PYTEST_ARGS[@]}" --junitxml "$STEPS/tests.xml" \
    tests/functional/test_attention.py::test_cuda_tempo_equals_torch \
    tests/functional/test_attention.py::test_cuda_int8_gradients \
    tests/functional/test_attention.py::test_cuda_fully_masked_rows_give_zero_and_finite_gradients \
    tests/functional/test_attention.py::test_cuda_keeps_no_sequence_by_sequence_tensor \
    tests/test_kinds.py::test_probes_recognise_a_model_moved_to_cuda_before_convert \
    tests/test_bench.py::test_on_a_gpu_bandwidth_rows_have_the_kernels_device_time \
    tests/quant/test_triton_finish.py::test_a_pack_many_of_q_k_v_is_three_launches_a_tensor_and_one_host_read \
    tests/quant/test_triton_finish.py::test_one_pack_is_about_three_launches_and_one_host_read \
    tests/quant/test_triton_finish.py::test_a_running_pack_has_no_host_read \
    tests/quant/test_triton_finish.py::test_a_running_pack_is_three_launches_and_no_host_read \
    tests/quant/test_triton_finish.py::test_on_the_gpu_model_sized_packs_equal_the_references \
    tests/test_state.py tests/quant/test_triton_finish.py "${TRITON_TESTS[@]}"
# shellcheck disable=SC2016  # expanded by the inner bash
step check 45 1 env PY="$PY" bash -c 'rc=0
for model in gpt2 llama; do
    for policy in tempo int8; do
        "$PY" -m slimact check --model $model --tiny --policy $policy --device cuda || rc=1
    done
done
exit $rc'
step throughput 40 1 "$PY" -m slimact bench --throughput --device cuda --models gpt2 --layers 12 --seq 1024 \
    --dtypes bf16 --budget 24GiB --max-batch 64 --rounds 3 --policies int8 tempo --out "$STEPS" --name throughput

pack_up
rm -rf "$STEPS"
cat "$SUMMARY"
