#!/usr/bin/env bash
# Issue 39's GPU check in one call of at most 8 minutes on one GPU: `pytest -m cuda`, then training steps (ours
# as a CUDA run does by default, transformers + torch.compile, ours eager; one process per shape: 135m 16 x 1024,
# tiny 64 x 512, tiny 8 x 128), a torch.profiler look at the 135m default step (where its time goes), LoRA vs
# PEFT (on the donor GGUF when it is there, else on random weights of its shape: the same speed), greedy decode
# (ours vs transformers' static-cache compiled `generate`, random 135M weights); the last lines are one summary
# table. Each part runs under `timeout`, capped by what is left of BUDGET seconds (default 470), so the whole
# check ends in time and one part that overruns loses only its own figures; each part's output is tee'd to $OUT/.
#
#     bash benchmarks/gpu_check.sh           # on the GPU machine, from anywhere
#     DRY_RUN=1 bash benchmarks/gpu_check.sh # on a CPU (CI): the same commands at the toy `smoke` shape, on the CPU
#
# Needs torch, triton, transformers (and peft for LoRA) and what `../shared/tools/device_prep.sh` carries as
# wheels (gguf, hydra-core, omegaconf); not the donor (random weights run as fast).
# Environment: OUT (default benchmarks/results/gpu_check), PYTHON (python3), DONOR (smollm2 or a GGUF path),
# BUDGET (seconds for all parts), PARTS (some of: pytest train_135m profile lora train_tiny train_tiny_default
# decode; default all, in that order).
set -u -o pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/gpu_check}"
DONOR="${DONOR:-smollm2}"
DRY="${DRY_RUN:-0}"
BUDGET="${BUDGET:-470}"
PARTS="${PARTS:-pytest train_135m profile lora train_tiny train_tiny_default decode}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
failed=0

part() {  # part NAME TIMEOUT ARGS...: one command under timeout (capped by the budget left), tee'd to $OUT/NAME.txt
    local name=$1 limit=$2 start=$SECONDS left=$((BUDGET - SECONDS))
    shift 2
    [ "$left" -lt 0 ] && left=0  # setting up may already have spent a second past a spent budget
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then echo "skipped: $name (${left}s of the ${BUDGET}s budget left)"; failed=1; return; fi
    echo "=== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=$?
    [ $rc -eq 124 ] && echo "($name stopped at its ${limit}s timeout: the lines above are what it measured)" \
        | tee -a "$OUT/$name.txt"
    [ $rc -ne 0 ] && failed=1
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

if [ "$DRY" = 1 ]; then  # every command once on the CPU at the smoke shape: arguments, imports and code paths
    device=cpu big=smoke small=smoke default=smoke steps=(--steps 1 --warmup 0) new=8 precisions=fp32
    contenders=ours-default,ours,hf lora=(--contenders ours --batch-size 1 --seq-len 128 --steps 1 --warmup 0)
    profile=(--device cpu --shape smoke --steps 1 --warmup 1) select=(-m cuda --collect-only)
else
    "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || { echo "no CUDA device"; exit 1; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    device=cuda big=135m small=tiny default=tiny-default steps=(--steps 10 --warmup 3) new=256 precisions=bf16
    contenders=ours-default,hf-compile,ours  # the two compiled first: a timeout then costs the eager one
    lora=(--contenders ours-compile,hf,ours --batch-size 8 --seq-len 1024 --steps 10 --warmup 3)
    profile=(--device cuda --shape 135m --compile --cuda-graph --steps 5 --warmup 3 --top 25
        --trace "$OUT/profile_135m_default.json.gz") select=(-m cuda)
fi
donor=random
"$PY" -c "from pipeline.gguf.reader import resolve_gguf_path as r; import sys; sys.exit(not r('$DONOR').is_file())" \
    2>/dev/null && donor=$DONOR

train() {  # train PART SHAPE LIMIT
    part "$1" "$3" "$PY" benchmarks/train_throughput.py --device "$device" --shapes "$2" \
        --contenders "$contenders" "${steps[@]}"
}
for p in $PARTS; do  # limits seen on an H100: 135m's two compiled contenders 103 s, tiny-default's 43 s
    case $p in
    pytest) part pytest_cuda 60 "$PY" -m pytest -q -p no:cacheprovider "${select[@]}" tests/test_fused.py \
        tests/test_fused_ce.py tests/test_gpu_paths.py tests/test_graphed.py tests/test_compile.py \
        tests/test_varlen.py ;;
    train_135m) train "$p" "$big" 150 ;;
    train_tiny) train "$p" "$small" 75 ;;
    train_tiny_default) train "$p" "$default" 70 ;;
    profile) part profile 80 "$PY" benchmarks/profile_step.py "${profile[@]}" --out "$OUT" ;;
    lora) part lora 120 "$PY" benchmarks/lora_speed.py --device "$device" --donor "$donor" --repeats 1 "${lora[@]}" ;;
    decode) part decode 110 "$PY" benchmarks/decode_speed.py --device "$device" --donor random --shape "$big" \
        --contenders ours,hf-static --precisions "$precisions" --prompt-tokens 32 --new-tokens "$new" --warmup 1 \
        --repeats 3 ;;
    *) echo "unknown part $p (known: pytest train_135m profile lora train_tiny train_tiny_default decode)"; exit 2 ;;
    esac
done

echo
echo "=== summary ($device): tokens/s, MFU and peak memory per contender; ratios to the fastest transformers one"
for f in "$OUT"/train_*.txt "$OUT"/decode.txt "$OUT"/lora.txt; do
    [ -f "$f" ] || continue
    echo "--- $(basename "$f" .txt)"
    grep -E "tok/s|ratio|^  (ours|hf)[a-z-]* |^ +(ours|hf)[a-z-]* +([0-9]|failed)|contender|GGUF, LoRA|x [0-9]+ = |^\| " "$f" | grep -v -E "^(command|decode tok/s|tok/s \()" | head -20
done
if [ -f "$OUT/profile.txt" ]; then  # the step's time, launches, idle share and time by category
    echo "--- profile"
    grep -E "^(step|kernels):" "$OUT/profile.txt"
    sed -n '/^time by category/,/^top /p' "$OUT/profile.txt" | head -12
fi
[ -f "$OUT/pytest_cuda.txt" ] && grep -E "passed|failed|error|collected" "$OUT/pytest_cuda.txt" | tail -1
exit $failed
