#!/usr/bin/env bash
# The GPU checks in one command (at most ~9 minutes on one H200), run from the repository root:
#
#   bash /work/shared/tools/gpu-wheels.sh build/wheels-gpu     # here, once: the wheels the GPU image lacks
#   bash benchmarks/gpu_check.sh [WHEELS_DIR]                        # there, with WHEELS_DIR carried
#
# Installs the carried wheels into a private site dir (no index, no deps: the image keeps its own
# torch and transformers), runs the project from PYTHONPATH, then: `pytest -m gpu -x`, the engine
# benchmark (0.6B-shape Qwen3, bf16), the publish-transfer benchmark (disk vs distributed), and the
# mode comparison on the built-in engine (0.6B, real training and publishes) and on the simulated one
# (async with and without an overlapped publish).
# Logs and timeline pages (HTML) go under $OUT (default ./gpu-out); each step has its own time limit, and a
# failed step does not stop the others (the summary at the end says which failed).
set -uo pipefail
wheels=${1:-build/wheels-gpu}
out=${OUT:-./gpu-out}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
  > "$out/install.log" 2>&1 || { echo "wheel install failed: see $out/install.log"; exit 2; }
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())' \
  >> "$out/gpu.txt" 2>&1
status=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  status+=("$name rc=$rc $((SECONDS - t0))s")
  echo "== $name rc=$rc ($((SECONDS - t0)) s)"; tail -n 15 "$out/$name.log"
}
step pytest-gpu 150 python3 -m pytest -m gpu -x -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py
step engine 90 python3 -m benchmarks.engine --device cuda --dtype bfloat16 --qwen3-06b --batches 1,32,128 --steps 10 --skip-old
step publish-transfer 75 python3 -m benchmarks.publish_transfer --device cuda --dtype bfloat16 --model-size 0.6b --publishes 3
step modes-builtin 150 python3 -m benchmarks.modes --engine builtin --device cuda --model-size 0.6b --steps 6 \
  --timeline-dir "$out/timelines"
step modes-sim 60 python3 -m benchmarks.modes --seeds 1 --steps 6 --only async --only "async, overlap" \
  --timeline-dir "$out/timelines"
printf '%s\n' "${status[@]}" | tee "$out/summary.txt"
