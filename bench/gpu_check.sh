#!/usr/bin/env bash
# The project's GPU check: the GPU test suite, the engine's benchmark rows, run.py end to end on CUDA, the log-prob
# gap and the training rows, every result in one directory (8 files: what the device tool brings back). Run it
# whenever a GPU is at hand and record what it prints in BENCHMARKS.md ("GPU") with the machine, the date and the
# command.
#
#   bash bench/gpu_check.sh [OUT_DIR] [PARTS]     # PARTS: comma list (default: tests,engine,run,gap,train)
#   BUDGET=450 bash bench/gpu_check.sh ...        # seconds for the whole script (default 450)
#
# A lent machine has 15 device-minutes in all, its start (1-2 minutes) included, so the check is one call of the
# device tool (timeout_s 510) that ends inside BUDGET: the parts run in this order, each under `timeout` for the
# smaller of its own cap and what is left of BUDGET, and a part cut off counts as failed, its output kept. What is
# left after one call is enough for a second, shorter one, e.g. `BUDGET=240 bash bench/gpu_check.sh OUT train`.
#   tests   (cap 150 s) python -m pytest -m gpu tests/test_gpu.py: the engine's CUDA graphs vs its eager step (fp32,
#           bf16), per-prompt seeds on CUDA, bf16 training vs the CPU, attention and CE backends, log-probs vs the
#           trainer, FSDP2 on NCCL
#   engine  (cap 110 s) bench/bench_gpu.py rollouts on the Qwen2.5-1.5B shape (bf16, random weights): the rollout mix
#           (256 prompts), then batch 256 / 1 / 32 at 128 new tokens, CUDA graphs on; issue 36's goals
#   run     (cap 150 s) python run.py --gpus 1 on three tasks of the embedded benchmark with sft, replay and opr-ru
#           (the tiny preset: train.py in bf16 on CUDA, the engine with CUDA graphs), then its report. The tiny base
#           takes minutes to build (on the CPU, by design), so build it here and let it travel: `OPR_CACHE=.cache/opr
#           python -c "from model.base import ensure_base; ensure_base('tiny')"`, then carry `.cache/opr`; the script
#           puts it where ensure_base looks (BASE=DIR names another)
#   gap     (cap 40 s) bench/bench_logprob_gap.py: engine vs trainer log-probs with a bf16 and an fp32 LM head
#   train   (what is left) bench/bench_gpu.py training MFU: Qwen2.5-0.5B and -1.5B, eager and compiled blocks at
#           16,384 tokens per micro-batch, then compiled at train.py's memory-filling default (--micro-tokens auto)
# Machines without network (the lent H100): the Python packages the project needs beyond torch and transformers
# travel as wheels in .whl/ (see /work/.library/device/README.md), installed here into /tmp/site when present:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     rapidfuzz rouge-score nltk liger-kernel rouge==1.0.1 fuzzywuzzy==0.18.0 levenshtein gguf
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
PARTS=${2:-tests,engine,run,gap,train}
BUDGET=${BUDGET:-450}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; } > "$OUT/gpu_check.txt" 2>&1
exec > >(tee -a "$OUT/gpu_check.txt") 2>&1  # the script's own lines after the machine's
rc=0

# part NAME CAP COMMAND...: runs COMMAND if NAME is in PARTS, under the smaller of CAP and the budget's rest, output
# in OUT/NAME.txt; a part for which under 20 s are left is skipped (and counts as failed)
part() {
    local name=$1 cap=$2; shift 2
    case ",$PARTS," in *,"$name",*) ;; *) return;; esac
    local left=$((BUDGET - (SECONDS - START)))
    [ "$cap" -gt "$left" ] && cap=$left
    if [ "$cap" -lt 20 ]; then
        echo "gpu_check.sh: $name skipped, ${left}s of the budget left" | tee "$OUT/$name.txt"; rc=1; return
    fi
    echo "gpu_check.sh: $name (at most ${cap}s)"
    timeout --kill-after=10 "$cap" "$@" > "$OUT/$name.txt" 2>&1
    local r=$?
    [ $r -eq 124 ] && echo "gpu_check.sh: $name cut off after ${cap}s" | tee -a "$OUT/$name.txt"
    echo "gpu_check.sh: $name exit $r after $((SECONDS - START))s in all"
    [ $r -ne 0 ] && rc=1
}

part tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=20 tests/test_gpu.py
engine_rows() {  # the rollout mix first, then batch 256, 1, 32 at 128 new tokens: issue 36's goals in that order
    local r=0
    python3 bench/bench_gpu.py --configs qwen2.5-1.5b --mixes '' --rollout-batches '' --rollout-mix-prompts 256 \
        --out "$OUT/bench.jsonl" --timeout 60 || r=1
    python3 bench/bench_gpu.py --configs qwen2.5-1.5b --mixes '' --rollout-batches 256,1,32 --rollout-new-tokens 128 \
        --rollout-mix-prompts 0 --out "$OUT/bench.jsonl" --timeout 45 || r=1
    return $r
}
export -f engine_rows
export OUT
part engine 110 bash -c engine_rows
BASE=${BASE:-$(ls -d .cache/opr/tiny-instruct-* 2>/dev/null | head -n 1)}  # the carried tiny base, if any
[ -n "$BASE" ] && echo "gpu_check.sh: base $BASE"
export BASE RUN_DIR=${RUN_DIR:-/tmp/gpu_check_run}  # its steps/ stay out of OUT: the report and numbers come back
run_end_to_end() {  # the device tool brings back 8 files: report.md beside, results and timings in run.txt
    # run.py --model would select the paper preset: the carried base goes where ensure_base("tiny") looks for it
    # instead (its name hashes torch's version, so this machine's name differs from the one it was built under)
    local want
    want=$(python3 -c "from data.embedded import cache_dir; from model.base import tiny_recipe_hash
print(cache_dir() / f'tiny-instruct-{tiny_recipe_hash()}')") || return 1
    [ -n "$BASE" ] && [ ! -e "$want" ] && mkdir -p "$(dirname "$want")" && cp -r "$BASE" "$want"
    python3 run.py --gpus 1 --tasks C-STANCE,FOMC,NumGLUE-cm --methods sft,replay,opr-ru --out "$RUN_DIR" --quiet \
        || return 1
    cp "$RUN_DIR/report.md" "$OUT/report.md"
    for f in results.json timing.json; do echo "== $f"; cat "$RUN_DIR/$f"; done
}
export -f run_end_to_end
part run 150 bash -c run_end_to_end
part gap 40 python3 bench/bench_logprob_gap.py --prompts 128 ${BASE:+--ckpt "$BASE"}
train_rows() {  # eager and compiled at 16,384 tokens, then compiled at the memory-filling default
    python3 bench/bench_gpu.py --configs qwen2.5-0.5b,qwen2.5-1.5b --mixes trace --ac off --compile both \
        --attn torch_varlen --ce liger --rollout-batches '' --rollout-mix-prompts 0 --steps 3 --warmup 1 \
        --out "$OUT/bench.jsonl" --timeout 120 || return 1
    python3 bench/bench_gpu.py --configs qwen2.5-1.5b --mixes trace --ac off --compile on --micro-tokens auto \
        --attn torch_varlen --ce liger --rollout-batches '' --rollout-mix-prompts 0 --steps 3 --warmup 1 \
        --out "$OUT/bench.jsonl" --timeout 120
}
export -f train_rows
part train 100000 bash -c train_rows
echo "gpu_check.sh: parts $PARTS done in $((SECONDS - START))s, exit $rc; results in $OUT"
exit $rc
