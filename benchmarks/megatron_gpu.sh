#!/usr/bin/env bash
# The megatron backend's GPU checks in one command (about 3-4 minutes on one H200), from the repository root:
#
#   bash benchmarks/megatron_gpu.sh [WHEELS_DIR]      # WHEELS_DIR: the cp312 wheels the GPU image lacks (carried)
#
# 1. `pytest -m gpu tests/test_megatron_gpu.py -k "learns and bfloat16"`: the built-in task end to end
#    through `python -m pipeline.launch --train-backend megatron --trainer-device cuda --trainer-dtype bfloat16`
#    (reward must rise over 12 steps); prints reward, train step time and the trainer-vs-engine log-prob gap.
# 2. `benchmarks.trainer_backends --dtype bfloat16,float32`: one GRPO step of each backend on the
#    Qwen3-0.6B-shaped model, bf16 then fp32, median of 3 after a warm-up, with peak GPU memory
#    (BENCHMARKS.md section 9).
# Logs go under $OUT (default ./gpu-out); the last lines printed are the figures.
set -uo pipefail
wheels=${1:-.wheels-gpu}
out=${OUT:-./gpu-out}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
  > "$out/install.log" 2>&1 || { echo "wheel install failed: see $out/install.log"; exit 2; }
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
timeout 110 python3 -m pytest -n 0 -m gpu -x -q -s -p no:cacheprovider tests/test_megatron_gpu.py -k "learns and bfloat16" \
  > "$out/megatron-e2e-bf16.log" 2>&1
echo "== e2e bf16 rc=$?"; grep -E "megatron on GPU|passed|failed|Error" "$out/megatron-e2e-bf16.log" | tail -8
timeout 120 python3 -m benchmarks.trainer_backends --device cuda --dtype bfloat16,float32 --steps 3 \
  > "$out/trainer-backends.log" 2>&1
echo "== trainer backends rc=$?"; grep -E '^\{|Error' "$out/trainer-backends.log" | tail -6
