#!/usr/bin/env bash
# The project's GPU check: one call of the device tool that returns what a lent GPU can tell us, every result in one
# flat directory of at most 8 files (the device tool's limit). Record what it prints in BENCHMARKS.md ("GPU") with the
# machine, the date and the command.
#
#   bash bench/gpu_check.sh [OUT_DIR] [PARTS]     # PARTS: comma list (default: train,engine,run,tests,gap)
#   BUDGET=450 bash bench/gpu_check.sh ...        # seconds for the whole script (default 450)
#   REHEARSAL=1 bash bench/gpu_check.sh ...       # the CPU rehearsal: same parts, order, caps and files, tiny shapes
#   CAP_tests=200 bash bench/gpu_check.sh OUT tests   # another cap for one part (a second call with what is left)
#
# A lent machine has 15 device-minutes in all, its start (1-2 minutes) included: the call is
# `bash bench/gpu_check.sh "$OUT"` with timeout_s 510 and carry [".whl", ".cache/opr"] (BENCHMARKS.md, "GPU").
# Parts run in this order, each under `timeout -s INT` for the smaller of its cap and what is left of BUDGET (a part
# with under 20 s left is skipped); the order is what we know least first, each cap one the part can meet:
#   pre     (seconds) CUDA visible, the wheels import, exactly one carried tiny base: else one line and exit 2
#   train   (150 s)   compiled training (train.py's GPU default) has never run: Qwen2.5-1.5B then -0.5B compiled,
#                     then both eager (the ratio on the same machine); each row printed the moment it is measured
#   engine  (100 s)   the continuous-batching engine has never run on a GPU: the rollout mix, then batch 256, 1, 32
#   run     (80 s)    the pipeline end to end on CUDA in 9 steps (2 tasks, sft + opr-ru, 1 epoch, 32/16 examples, no
#                     drift), not quiet; its report and numbers come back partial or not
#   tests   (100 s)   the GPU suite, verbose: SIGINT at the cap still prints what passed and what failed
#   gap     (rest)    engine vs trainer log-probs with a bf16 and an fp32 LM head: the least new, measured before
# Files: gpu_check.txt (machine, preconditions, the parts' exits), train.txt, engine.txt, run.txt, tests.txt,
# gap.txt, bench.jsonl (every bench_gpu row), report.md (the run's).
#
# Machines without network (the lent H100): the packages the project needs beyond torch and transformers travel as
# wheels in .whl/, installed here into /tmp/site; rouge-score publishes no wheel, so it is built locally:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     rapidfuzz nltk click joblib absl-py liger-kernel rouge==1.0.1 fuzzywuzzy==0.18.0 levenshtein gguf sacrebleu portalocker
#   python3 -m pip wheel --no-deps -w .whl rouge-score==0.1.2
# The tiny base builds on the CPU for minutes, so it is built here and carried:
#   OPR_CACHE=.cache/opr python -c "from model.base import ensure_base; ensure_base('tiny')"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
PARTS=${2:-train,engine,run,tests,gap}
BUDGET=${BUDGET:-450}
REHEARSAL=${REHEARSAL:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  git log -1 --format='commit %h %s' 2>/dev/null; } > "$OUT/gpu_check.txt" 2>&1
exec > >(tee -a "$OUT/gpu_check.txt") 2>&1  # the script's own lines after the machine's

# ---- shapes: the GPU's, or the rehearsal's (CPU, tiny, seconds) -------------------------------------------------
if [ -n "$REHEARSAL" ]; then
    DEVICE="--device cpu"; GPUS=0
    TRAIN_SHAPES="--configs tiny --global-batch 8 --micro-tokens 2048 --max-len 512 --steps 1 --warmup 1"
    TRAIN_COMPILED="--compile off"  # compiling costs the CPU seconds the rehearsal does not need: same control flow
    ENGINE_SHAPES="--configs tiny --max-len 512"; MIX_PROMPTS=6; BATCHES=1,3; NEW_TOKENS=5
    RUN_SIZES="--n-train 8 --n-test 4 --global-batch 4 --max-new-tokens 8"
    GAP_SIZES="--prompts 4 --max-new-tokens 4"
else
    DEVICE=""; GPUS=1
    TRAIN_SHAPES="--configs qwen2.5-1.5b,qwen2.5-0.5b --steps 3 --warmup 1 --attn torch_varlen --ce liger"
    TRAIN_COMPILED="--compile on"
    ENGINE_SHAPES="--configs qwen2.5-1.5b"; MIX_PROMPTS=256; BATCHES=256,1,32; NEW_TOKENS=128
    RUN_SIZES="--n-train 32 --n-test 16"
    GAP_SIZES="--prompts 128"
fi

# ---- preconditions: seconds, each a one-line abort ----------------------------------------------------------------
abort() { echo "gpu_check.sh: abort: $*"; exit 2; }
[ -n "$REHEARSAL" ] || python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    || abort "no CUDA device visible (REHEARSAL=1 runs the parts on the CPU)"
need="import data.metrics, engine.engine, run, train, rollout, evaluate, score, drift"
[ -n "$REHEARSAL" ] || need="$need; from kernels.cross_entropy import _load_liger; assert _load_liger(), 'liger_kernel'"
python3 -c "$need" 2>/dev/null || abort "the project does not import here: $(python3 -c "$need" 2>&1 | tail -n 1)" \
    "(the wheels in .whl/: see this script's header)"
bases=$(ls -d .cache/opr/tiny-instruct-* 2>/dev/null)
BASE=${BASE:-$bases}
case "$BASE" in
    "") abort "no carried tiny base in .cache/opr (this script's header says how to build it; BASE=DIR names one)";;
    *$'\n'*) abort "several carried tiny bases in .cache/opr, name one with BASE=DIR: $(echo $BASE)";;
esac
for f in config.json model.safetensors tokenizer.json; do
    [ -f "$BASE/$f" ] || abort "the tiny base $BASE has no $f"
done
echo "gpu_check.sh: preconditions met in $((SECONDS - START))s; base $BASE"
rc=0

# part NAME CAP COMMAND...: runs COMMAND if NAME is in PARTS, under the smaller of CAP (or $CAP_NAME) and the budget's
# rest, output in OUT/NAME.txt; skipped when under 20 s of the budget are left; SIGINT at the cap (pytest and bench_gpu then still print what they have), SIGKILL 10 s later
part() {
    local name=$1 cap_var=CAP_$1 cap
    cap=${!cap_var:-$2}; shift 2
    case ",$PARTS," in *,"$name",*) ;; *) return;; esac
    local left=$((BUDGET - (SECONDS - START)))
    [ "$cap" -gt "$left" ] && cap=$left
    if [ "$left" -lt 20 ]; then
        echo "gpu_check.sh: $name skipped, ${left}s of the budget left" | tee "$OUT/$name.txt"; rc=1; return
    fi
    echo "gpu_check.sh: $name (at most ${cap}s)"
    timeout -s INT --kill-after=10 "$cap" "$@" > "$OUT/$name.txt" 2>&1
    local r=$?
    [ $r -eq 124 ] && echo "gpu_check.sh: $name cut off after ${cap}s" | tee -a "$OUT/$name.txt"
    echo "gpu_check.sh: $name exit $r after $((SECONDS - START))s in all"
    [ $r -ne 0 ] && rc=1
}
export OUT DEVICE TRAIN_SHAPES TRAIN_COMPILED ENGINE_SHAPES MIX_PROMPTS BATCHES NEW_TOKENS RUN_SIZES GPUS BASE

train_rows() {  # compiled first (the unknown), then eager: --micro-tokens 16,384 (bench_gpu's default) throughout
    local r=0
    python3 bench/bench_gpu.py $DEVICE $TRAIN_SHAPES --mixes trace --ac off $TRAIN_COMPILED --rollout-batches '' \
        --rollout-mix-prompts 0 --out "$OUT/bench.jsonl" --timeout 75 || r=1
    python3 bench/bench_gpu.py $DEVICE $TRAIN_SHAPES --mixes trace --ac off --compile off --rollout-batches '' \
        --rollout-mix-prompts 0 --out "$OUT/bench.jsonl" --timeout 45 || r=1
    return $r
}
engine_rows() {  # the rollout mix first, then the fixed batches: issue 36's goals in that order
    local r=0
    python3 bench/bench_gpu.py $DEVICE $ENGINE_SHAPES --mixes '' --rollout-batches '' --rollout-mix-prompts $MIX_PROMPTS \
        --out "$OUT/bench.jsonl" --timeout 45 || r=1
    python3 bench/bench_gpu.py $DEVICE $ENGINE_SHAPES --mixes '' --rollout-batches $BATCHES \
        --rollout-new-tokens $NEW_TOKENS --rollout-mix-prompts 0 --out "$OUT/bench.jsonl" --timeout 40 || r=1
    return $r
}
run_end_to_end() {  # the run's steps stay in RUN_DIR; its report and numbers come back whether it finished or not
    # run.py --model would select the paper preset: the carried base goes where ensure_base("tiny") looks for it
    # instead (its name hashes torch's version, so this machine's name differs from the one it was built under)
    local want r=0
    want=$(python3 -c "from data.embedded import cache_dir; from model.base import tiny_recipe_hash
print(cache_dir() / f'tiny-instruct-{tiny_recipe_hash()}')") || return 1
    [ -e "$want" ] || { mkdir -p "$(dirname "$want")" && cp -r "$BASE" "$want"; } || return 1
    trap 'copy_back; exit 130' INT
    python3 run.py --gpus $GPUS --tasks C-STANCE,FOMC --methods sft,opr-ru --epochs 1 $RUN_SIZES --drift-limit 0 \
        --out "$RUN_DIR" || r=$?
    copy_back
    return $r
}
copy_back() {
    [ -f "$RUN_DIR/report.md" ] && cp "$RUN_DIR/report.md" "$OUT/report.md"
    for f in results.json timing.json manifest.json; do [ -f "$RUN_DIR/$f" ] && { echo "== $f"; cat "$RUN_DIR/$f"; }; done
    return 0
}
export RUN_DIR=${RUN_DIR:-$(mktemp -d /tmp/gpu_check_run.XXXX)/run}  # its steps/ stay out of OUT
export -f train_rows engine_rows run_end_to_end copy_back

part train 150 bash -c train_rows
part engine 100 bash -c engine_rows
part run 80 bash -c run_end_to_end
part tests 100 python3 -m pytest -v -rA -p no:cacheprovider -m gpu --durations=10 tests/test_gpu.py
part gap 100000 python3 bench/bench_logprob_gap.py $DEVICE $GAP_SIZES --ckpt "$BASE"
echo "gpu_check.sh: parts $PARTS done in $((SECONDS - START))s, exit $rc; results in $OUT"
exit $rc
