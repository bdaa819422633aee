#!/usr/bin/env bash
# Issue 19's GPU figures in one go (one H100, bf16): training throughput, LoRA steps and greedy decode, each
# benchmark under `timeout` (defaults add up to 9 minutes, so the whole run fits one 10-minute device call),
# each one's output tee'd to $OUT/ (default benchmarks/results/). Run from the repository root:
#
#     bash benchmarks/gpu_commands.sh                 # all three
#     bash benchmarks/gpu_commands.sh train           # or some of: train lora decode profile
#
# `profile` (not in the default list: the three fill one call) says where a training step's time goes: our loop
# on the 135m shape under torch.profiler (benchmarks/profile_step.py: step time and MFU, host waits per step and
# where they come from, kernels per step, GPU idle share, time by category, top kernels): eager (with the Triton
# kernels of pipeline/models/ops/fused.py), eager without them (--plain), then compiled, each its own invocation (a
# compile that runs past its timeout loses only its own figures). Run it as the follow-up call (about 5 minutes
# at most):
#     bash benchmarks/gpu_commands.sh profile qlora
# It also writes $OUT/profile_135m_cuda[_compile].json and gzipped chrome traces $OUT/profile_135m_*.json.gz.
# `qlora` (also not in the default list) runs QLoRA on the donor's own Q4_1 blocks and on Q8_0 / Q4_0 bases
# that gguf-py requantizes from it, against ours (LoRA on bf16) and PEFT: the issue's QLoRA-on-CUDA figures.
# (K-quant bases need llama.cpp's quantizer, which the GPU host lacks.)
#
# Most of the time goes to torch.compile (ours-compile, hf-compile, hf-static: roughly 0.5-2 min per model on
# a 16-core host); every benchmark prints each contender's line as it finishes, so one that runs past its
# timeout still leaves the lines it printed (train: also a Markdown row per shape; lora: --log JSONL).
# With more device time, two calls with longer timeouts are safer, e.g.
#     TRAIN_TIMEOUT=540 bash benchmarks/gpu_commands.sh train
#     LORA_TIMEOUT=240 DECODE_TIMEOUT=300 bash benchmarks/gpu_commands.sh lora decode
#
# What the GPU host lacks (its python3 has torch, transformers and peft; nothing can be downloaded there):
# gguf-py, hydra and the donor GGUF (98 MB, more than one 64 MiB call carries). Prepare them here with the
# shared device tool (it still names the old module `pipeline.gguf_io`, hence the sed):
#     sed 's/pipeline.gguf_io/pipeline.gguf.reader/' ../shared/tools/device_prep.sh | bash
# then make the three device calls it prints, back to back (part-00, part-01, then part-02 + pkg.tar + whl +
# setup.sh), the third one being
#     source .device/setup.sh && bash benchmarks/gpu_commands.sh
# Without the donor: lora is skipped and decode runs the 135M shape with random weights on both sides (same
# speed, meaningless ids). liger-kernel (optional, hf-liger): add `liger-kernel` to device_prep's arguments.
#
# Environment: OUT (results folder), PYTHON (default python3), DONOR (smollm2 or a GGUF path),
# TRAIN_TIMEOUT / LORA_TIMEOUT / DECODE_TIMEOUT (seconds; defaults 260 / 120 / 160), PROFILE_TIMEOUT /
# PROFILE_COMPILE_TIMEOUT (defaults 90 / 150), QLORA_TIMEOUT (180), DRY_RUN=1 (print the commands, run nothing: to check the script
# where there is no GPU).
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
PY="${PYTHON:-python3}"
DONOR="${DONOR:-smollm2}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(train lora decode)

has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

donor_ok() {  # the donor GGUF is there and gguf-py can read it
    "$PY" -c "from pipeline.gguf.reader import resolve_gguf_path as r; import sys; sys.exit(not r('$DONOR').is_file())" \
        2>/dev/null
}

bench() {  # bench NAME TIMEOUT ARGS...: one benchmark under timeout, tee'd to $OUT/gpu_NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "=== $name (timeout ${limit}s): $PY $*"
    [ "${DRY_RUN:-0}" = 1 ] && return
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$PY" "$@" 2>&1 | tee "$OUT/gpu_$name.txt"
    local rc=$?
    [ $rc -eq 124 ] && echo "($name stopped at its ${limit}s timeout: the lines above are what it measured)" \
        | tee -a "$OUT/gpu_$name.txt"
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

if [ "${DRY_RUN:-0}" != 1 ]; then
    "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || { echo "no CUDA device: nothing to run"; exit 1; }
fi
[ "${DRY_RUN:-0}" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    | tee "$OUT/gpu_device.txt"
has liger_kernel || echo "skipped: liger_kernel not installed (train's hf-liger contender)"
has peft || echo "skipped: peft not installed (lora's hf contender)"
donor_ok && have_donor=1 || have_donor=0
[ $have_donor -eq 0 ] && echo "no donor GGUF readable as DONOR=$DONOR (see the header: device_prep)"

for part in "${parts[@]}"; do
    case $part in
    train)
        bench train "${TRAIN_TIMEOUT:-260}" benchmarks/train_throughput.py --device cuda \
            --shapes 135m,tiny,small,tiny-default --contenders ours,ours-plain,ours-graph,ours-compile,hf,hf-compile,hf-liger \
            --steps 10 --warmup 3
        ;;
    lora)
        if [ $have_donor -eq 0 ]; then
            echo "skipped: lora (it needs the donor GGUF; see the top of this script)"
            continue
        fi
        contenders=ours,hf,ours-compile  # the compiled one last: a timeout then costs only it
        has peft || contenders=ours,ours-compile
        rm -f "$OUT/gpu_lora_children.jsonl"
        bench lora "${LORA_TIMEOUT:-120}" benchmarks/lora_speed.py --device cuda --donor "$DONOR" \
            --contenders "$contenders" --batch-size 8 --seq-len 1024 --repeats 1 --steps 10 --warmup 3 \
            --log "$OUT/gpu_lora_children.jsonl"
        ;;
    decode)
        donor=$DONOR
        [ $have_donor -eq 0 ] && donor=random && echo "decode: --donor random (the 135M shape, random weights)"
        bench decode "${DECODE_TIMEOUT:-160}" benchmarks/decode_speed.py --device cuda --donor "$donor" \
            --shape 135m --contenders ours,hf,hf-static --precisions bf16,fp32 --prompt-tokens 32 \
            --new-tokens 256 --warmup 1 --repeats 3
        ;;
    profile)
        for mode in eager plain compile; do
            flag=() name=profile limit=${PROFILE_TIMEOUT:-90}
            [ $mode = plain ] && flag=(--plain) name=profile_plain
            [ $mode = compile ] && flag=(--compile) name=profile_compile limit=${PROFILE_COMPILE_TIMEOUT:-150}
            bench $name "$limit" benchmarks/profile_step.py --device cuda --shape 135m "${flag[@]}" --steps 5 \
                --warmup 3 --out "$OUT" --trace "$OUT/profile_135m_$mode.json.gz"
        done
        ;;
    qlora)
        if [ $have_donor -eq 0 ]; then
            echo "skipped: qlora (it needs the donor GGUF; see the top of this script)"
            continue
        fi
        contenders=ours,hf,qlora-q4_1,qlora-q8_0,qlora-q4_0
        has peft || contenders=ours,qlora-q4_1,qlora-q8_0,qlora-q4_0
        bench qlora "${QLORA_TIMEOUT:-180}" benchmarks/lora_speed.py --device cuda --donor "$DONOR" \
            --contenders "$contenders" --batch-size 8 --seq-len 1024 --repeats 1 --steps 10 --warmup 3 \
            --log "$OUT/gpu_qlora_children.jsonl"
        ;;
    *) echo "unknown part $part (train, lora, decode, profile, qlora)" ;;
    esac
done
