#!/usr/bin/env bash
# The project's GPU check: the GPU test suite, the GPU benchmark rows that matter, and run.py end to end on CUDA,
# every result in one directory. Run it whenever a GPU is at hand and record what it prints in BENCHMARKS.md ("GPU")
# with the machine, the date and the command.
#
#   bash bench/gpu_check.sh [OUT_DIR] [PARTS]        # PARTS: comma list of tests,bench,run (default: all three)
#
# Each part takes under 10 minutes on one H100 (the device tool's limit per command), so a lent machine runs it as
# three calls, e.g. `bash bench/gpu_check.sh $OUT tests`, then `... bench`, then `... run`.
#   tests  python -m pytest -m gpu tests (bf16 training vs the CPU, attention and CE backends, the engine's CUDA graphs
#          vs its eager step, log-probs vs the trainer, FSDP2 on NCCL), then tests/test_engine.py (the engine against
#          its reference sampler; on the CPU, as everywhere)
#   bench  bench/bench_gpu.py: training MFU of Qwen2.5-0.5B, -1.5B and the 7B width cut to 4 layers (trace mix, no
#          activation checkpointing, torch varlen attention, liger CE), eager and compiled blocks at 16,384 tokens per
#          micro-batch, then compiled at train.py's memory-filling default (--micro-tokens auto); the engine on the Qwen2.5-1.5B shape at batch 1 / 32 /
#          256 and on the rollout mix, CUDA graphs on (and off at batch 32); the engine/trainer log-prob gap with a bf16
#          and an fp32 LM head (bench/bench_logprob_gap.py, on the tiny base)
#   run    python run.py --gpus 1 on three tasks of the embedded benchmark with sft, replay and opr-ru (the tiny preset:
#          train.py in bf16 on CUDA, the native engine with CUDA graphs), then its report
# Machines without network (the lent H100): the Python packages the project needs beyond torch and transformers
# travel as wheels in .whl/ (see /work/.library/device/README.md), installed here into /tmp/site when present:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     rapidfuzz rouge-score nltk liger-kernel rouge==1.0.1 fuzzywuzzy==0.18.0 levenshtein gguf
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
PARTS=${2:-tests,bench,run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; } > "$OUT/machine.txt" 2>&1
rc=0
case ",$PARTS," in *,tests,*)
    { r=0; python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py || r=1
      python3 -m pytest -q -p no:cacheprovider tests/test_engine.py || r=1; exit $r; } 2>&1 | tee "$OUT/tests.txt"
    rc=$((rc | ${PIPESTATUS[0]}));;
esac
case ",$PARTS," in *,bench,*)
    q7b4=$(mktemp -d)
    python3 - "$q7b4" <<'EOF'
import json, sys
cfg = json.load(open("bench/configs/qwen2.5-7b/config.json"))
cfg["num_hidden_layers"] = 4  # the paper model's width, 4 of its 28 layers: one H100 holds it with AdamW
json.dump(cfg, open(f"{sys.argv[1]}/config.json", "w"))
EOF
    ( r=0
      python3 bench/bench_gpu.py --configs qwen2.5-0.5b,qwen2.5-1.5b,"$q7b4" --mixes trace --ac off --compile both \
          --attn torch_varlen --ce liger --rollout-batches '' --rollout-mix-prompts 0 --out "$OUT/bench.jsonl" \
          --timeout 240 || r=1
      python3 bench/bench_gpu.py --configs qwen2.5-0.5b,qwen2.5-1.5b,"$q7b4" --mixes trace --ac off --compile on \
          --micro-tokens auto --attn torch_varlen --ce liger --rollout-batches '' --rollout-mix-prompts 0 \
          --out "$OUT/bench.jsonl" --timeout 240 || r=1
      python3 bench/bench_gpu.py --configs qwen2.5-1.5b --mixes '' --rollout-batches 1,32,256 --out "$OUT/bench.jsonl" \
          --timeout 240 || r=1
      python3 bench/bench_gpu.py --configs qwen2.5-1.5b --mixes '' --rollout-batches 32 --rollout-mix-prompts 0 \
          --rollout-graphs off --out "$OUT/bench.jsonl" --timeout 240 || r=1
      python3 bench/bench_logprob_gap.py --prompts 128 || r=1
      exit $r ) 2>&1 | tee "$OUT/bench.txt"
    rc=$((rc | ${PIPESTATUS[0]}));;
esac
case ",$PARTS," in *,run,*)
    run_dir=${RUN_DIR:-/tmp/gpu_check_run}  # its steps/ stays out of OUT: only the report and numbers come back
    python3 run.py --gpus 1 --tasks C-STANCE,FOMC,NumGLUE-cm --methods sft,replay,opr-ru --out "$run_dir" --quiet \
        2>&1 | tee "$OUT/run.txt"
    rc=$((rc | ${PIPESTATUS[0]}))
    for f in report.md results.json timing.json; do cp "$run_dir/$f" "$OUT/$f" 2>/dev/null; done;;
esac
echo "gpu_check.sh: parts $PARTS done, exit $rc; results in $OUT"
exit $rc
