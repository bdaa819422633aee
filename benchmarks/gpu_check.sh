#!/usr/bin/env bash
# Issue 39's GPU check in one call of at most 8 minutes on one GPU: training steps (ours as a CUDA run does by
# default, ours eager, transformers + torch.compile; one process per shape: 135m 16 x 1024, tiny 8 x 128, tiny
# 64 x 512), greedy decode (ours vs transformers' static-cache compiled `generate`, random 135M weights), LoRA vs
# PEFT when the donor GGUF is there, then `pytest -m cuda`; the last lines are one summary table. Each part runs
# under `timeout`, so one that overruns loses only its own figures; each part's output is tee'd to $OUT/.
#
#     bash benchmarks/gpu_check.sh           # on the GPU machine, from anywhere
#     DRY_RUN=1 bash benchmarks/gpu_check.sh # on a CPU (CI): the same commands at the toy `smoke` shape, on the CPU
#
# Needs torch, triton, transformers (and peft for LoRA) and what `../shared/tools/device_prep.sh` carries as
# wheels (gguf, hydra-core, omegaconf); not the donor (random weights run as fast; without it LoRA is skipped).
# Environment: OUT (default benchmarks/results/gpu_check), PYTHON (python3), DONOR (smollm2 or a GGUF path).
set -u -o pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/gpu_check}"
DONOR="${DONOR:-smollm2}"
DRY="${DRY_RUN:-0}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
failed=0

part() {  # part NAME TIMEOUT ARGS...: one command under timeout, tee'd to $OUT/NAME.txt
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=$?
    [ $rc -eq 124 ] && echo "($name stopped at its ${limit}s timeout: the lines above are what it measured)" \
        | tee -a "$OUT/$name.txt"
    [ $rc -ne 0 ] && failed=1
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

if [ "$DRY" = 1 ]; then  # every command once on the CPU at the smoke shape: arguments, imports and code paths
    device=cpu shapes=(smoke smoke smoke) steps=(--steps 1 --warmup 0) new=8 precisions=fp32
    contenders=ours-default,ours,hf
else
    "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || { echo "no CUDA device"; exit 1; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    device=cuda shapes=(135m tiny-default tiny) steps=(--steps 10 --warmup 3) new=256 precisions=bf16
    contenders=ours-default,hf-compile,ours  # the two compiled first: a timeout then costs the eager one
fi

limits=(150 70 75)  # seen on an H100: 135m's two compiled contenders 103 s, tiny-default's 43 s
for i in 0 1 2; do
    part "train_${shapes[$i]}_$i" "${limits[$i]}" "$PY" benchmarks/train_throughput.py --device "$device" \
        --shapes "${shapes[$i]}" --contenders "$contenders" "${steps[@]}"
done
part decode 110 "$PY" benchmarks/decode_speed.py --device "$device" --donor random --shape "${shapes[0]}" \
    --contenders ours,hf-static --precisions "$precisions" --prompt-tokens 32 --new-tokens "$new" --warmup 1 --repeats 3
if "$PY" -c "from pipeline.gguf.reader import resolve_gguf_path as r; import sys; sys.exit(not r('$DONOR').is_file())" \
    2>/dev/null && [ "$DRY" != 1 ]; then
    part lora 80 "$PY" benchmarks/lora_speed.py --device cuda --donor "$DONOR" --contenders ours,hf,ours-compile \
        --batch-size 8 --seq-len 1024 --repeats 1 --steps 10 --warmup 3
else
    echo "skipped: lora (it reads the donor GGUF, $DONOR, which is not here; or DRY_RUN)"
fi
select=(-m cuda)
[ "$DRY" = 1 ] && select=(-m cuda --collect-only)
part pytest_cuda 60 "$PY" -m pytest -q -p no:cacheprovider "${select[@]}" tests/test_fused.py tests/test_fused_ce.py \
    tests/test_gpu_paths.py tests/test_graphed.py tests/test_compile.py

echo
echo "=== summary ($device): tokens/s, MFU and peak memory per contender; ratios to the fastest transformers one"
for f in "$OUT"/train_*.txt "$OUT"/decode.txt "$OUT"/lora.txt; do
    [ -f "$f" ] || continue
    echo "--- $(basename "$f" .txt)"
    grep -E "tok/s|ratio|^  (ours|hf)[a-z-]* |x [0-9]+ = |^\| " "$f" | grep -v -E "^(command|decode tok/s|tok/s \()" | head -20
done
grep -E "passed|failed|error|collected" "$OUT/pytest_cuda.txt" | tail -1
exit $failed
