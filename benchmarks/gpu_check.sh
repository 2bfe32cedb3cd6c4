#!/usr/bin/env bash
# The GPU checks (about 24 minutes on one H200 in all; run as subsets where a call has 10), run from the repository root:
#
#   bash benchmarks/gpu_wheels.sh build/wheels-gpu     # here, once: the wheels the GPU image lacks
#   bash benchmarks/gpu_check.sh [WHEELS_DIR]                        # there, with WHEELS_DIR carried
#   STEPS="engine" bash benchmarks/gpu_check.sh DIR                  # a subset: one step per call where
#   STEPS="modes-builtin" bash benchmarks/gpu_check.sh DIR           # a call has 10 min (limits 240 and 560 s: one call each)
#   STEPS="colocate" bash benchmarks/gpu_check.sh DIR                # colocated on one GPU: 520 s of limits
#   STEPS="trainer-step" bash benchmarks/gpu_check.sh DIR            # the torch trainer's step: 420 s
#   STEPS="engine-host" bash benchmarks/gpu_check.sh DIR             # the engine's cost per request: 150 s
#   STEPS="base-check" bash benchmarks/gpu_check.sh DIR              # time to target's base build: 240 s
#   STEPS="ttt" bash benchmarks/gpu_check.sh DIR                     # time to target: 570 s a call, the
#                                                                    # same command again continues (below;
#                                                                    # carry build/ttt-state from the last)
#   STEPS="ttt" TTT_FLAGS="--modes async-opsm-proximal --seeds 0,1" ...  # a diagnostic mode beside the set
#
# Installs the carried wheels into a private site dir (no index, no deps: the image keeps its own
# torch and transformers), runs the project from PYTHONPATH, then: `pytest -m gpu -x`, the engine
# benchmark (0.6B-shape Qwen3, bf16), the publish-transfer benchmark (disk vs distributed), and the
# mode comparison on the built-in engine (0.6B, real training and publishes, the simulated engine's
# length tail) and on the simulated engine with the same steps, groups, length limit and slots.
# Logs and timeline pages (HTML) go under $OUT (default ./gpu-out); each step has its own time limit, and a
# failed step does not stop the others (the summary at the end says which failed).
set -uo pipefail
wheels=${1:-build/wheels-gpu}
out=${OUT:-./gpu-out}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
  > "$out/install.log" 2>&1 || { echo "wheel install failed: see $out/install.log"; exit 2; }
rm -f "$out/install.log"  # kept only when it failed: a device call brings back at most 8 files
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
want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }   # STEPS="engine modes-builtin": a subset
named() { [[ " ${STEPS:-} " == *" $1 "* ]]; }   # a step that runs only when STEPS names it
want pytest-gpu && step pytest-gpu 170 python3 -m pytest -n 0 -m gpu -x -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py
want engine && step engine 240 python3 -m benchmarks.engine --device cuda --dtype bfloat16 --qwen3-06b --batches 1,16,128 \
  --contexts 256 --sweep-contexts "" --steps 10 --skip-old --fuse-ops --reference-batches 128
want publish-transfer && step publish-transfer 100 python3 -m benchmarks.publish_transfer --device cuda --dtype bfloat16 \
  --model-size 0.6b --publishes 3
# Responses up to 1024 tokens (the tail's median 153): at 256 a batch's generation took less of the
# GPU than its training step, so async was trainer-bound and the engine waited by design
# (BENCHMARKS.md 10b). Four steps: two between the first (warm-up) and the last (final checkpoint);
# six ran past the step's limit on 4 cores.
want modes-builtin && step modes-builtin 560 python3 -m benchmarks.modes --engine builtin --device cuda --model-size 0.6b \
  --dtype bfloat16 --steps 4 --length-tail lognormal:-1.9,0.8 --max-len 1024 --timeline-dir "$out/timelines"
# Time scale 0.1: at the default 0.02 its engine ran late on 16,138 forwards on 4 cores (its
# ratios then say nothing); about 80 s at 0.1.
# Colocated on one GPU (issue 47; STEPS="colocate", at most 8.7 minutes): the GPU tests (IPC publish
# bit-exact, release measured from outside, refusals, a dead trainer, a dead engine, a --colocate run), the publish
# benchmark's rows (disk, CUDA IPC, the colocated sequence with its resumes; 0.6B, bf16) and the
# largest Qwen3 shape that trains and generates colocated, with its memory split.
want colocate && step colocate-tests 150 python3 -m pytest -n 0 -m gpu -x -q -p no:cacheprovider -s tests/test_gpu_colocate.py
want colocate && step colocate-publish 100 python3 -m benchmarks.publish_transfer --device cuda --dtype bfloat16 \
  --model-size 0.6b --publishes 3
want colocate && step colocate-probe 270 python3 -m benchmarks.colocate_probe --shapes 4b,8b --smaller 1.7b,0.6b \
  --budget 235 --min-left 130
# The built-in engine's host cost per request in flight at the time-to-target set's shape (issue
# 48; only with STEPS="engine-host", about a minute): whether the ~90 us a request that bounded the
# async modes' throughput on the H100 is the engine's host work (BENCHMARKS 16, the tenth session),
# then the set's load (groups of 8 coming and going, the task's lengths: the eleventh session).
named engine-host && step engine-host 150 python3 -m benchmarks.engine_host --device cuda --dtype bfloat16 \
  --hidden 512 --layers 8 --heads 8 --requests 22,61 --tokens 300
# The torch trainer's step against its arithmetic (issue 48; only with STEPS="trainer-step"): first
# the GPU checks of packing and compiled layers (the same log-probs on the device), then the 0.6B
# shape's long-tailed batch: packed (trainers/packed_attention.py: varlen flash attention), packed
# with compiled layers only (--trainer-compile before 2026-12-06) and with --trainer-compile (the
# layers and the token scorer compiled, AdamW fused; its warm-up step compiles); then the profile
# of one compiled step and where its copies come from. On an H100 (BENCHMARKS 16): attention in
# padded blocks, before the variable-length kernel, took 1,335 ms against packed's 1,193, and
# `compiled with cache`, the forward before 2026-12-05, 1,230 ms against compiled's 817. Each
# trainer holds about 10 GB of fp32 weights, gradients and AdamW state beside a step's
# activations; padded's 87.5 GiB exceed an H100.
named trainer-step && step trainer-step-tests 120 python3 -m pytest -n 0 -m gpu -q -p no:cacheprovider \
  tests/test_packed_attention.py tests/test_layer_compile.py tests/test_token_scores.py
named trainer-step && step trainer-step 300 python3 -m benchmarks.trainer_step --device cuda --steps 4 \
  --variants "packed,compiled layers,compiled" --profile --profile-variant compiled
# The base model's build on this card (issue 48; only with STEPS="base-check", about 3 minutes):
# first the packed attention's GPU test (its variable-length kernel must run), then 200 steps of
# the h200 preset's base build, twice: the two fingerprints must match (strictly deterministic
# kernels, or a set's next session could not build its base again), and the seconds a step say
# what the whole build (2,000 steps) costs before a call is spent on it.
named base-check && step base-check-tests 60 python3 -m pytest -n 0 -m gpu -q -p no:cacheprovider \
  tests/test_packed_attention.py
for i in 1 2; do  # the preset's own build (time_to_target._prepare), cut to 200 steps
  named base-check && step "base-check-$i" 120 python3 -m benchmarks.time_to_target --preset h200 \
    --out "$out/base-$i" --prepare-only --base-steps 200
done
if named base-check; then
  python3 - "$out" <<'PY' | tee "$out/base-check.txt"
import json, sys
from pathlib import Path
built = [json.loads((Path(sys.argv[1]) / f"base-{i}" / "work" / "base" / "base.json").read_text()) for i in (1, 2)]
prints = [b["fingerprint"][:12] for b in built]
print(f"base check: {'the same weights' if prints[0] == prints[1] else 'DIFFERENT weights'} ({prints[0]}, {prints[1]}); "
      f"deterministic {[b['deterministic'] for b in built]}; 200 steps in {[round(b['seconds']) for b in built]} s")
PY
  rm -rf "$out"/base-1 "$out"/base-2  # 38 MB each: the verdict is what comes back
fi
# Time to a reward target (issue 48; only with STEPS="ttt"): every mode x 3 seeds of the long-answer
# task, each a real launcher run, one at a time, appended to $TTT_DIR/runs.jsonl as it ends. A call
# runs what fits in TTT_BUDGET seconds (a run is not started past it) and the same command again
# continues: runs.jsonl, state.json and the base model (bf16, in parts base.tar.part-NN of at most
# 15 MiB, the first time) come back in $OUT/ttt/; put them all in build/ttt-state/ and carry that
# folder to the next call, which then skips the base model's 4.4 minutes on the H200
# (`TTT_FLAGS=--prepare-only`: a first call that builds it and runs nothing, so that no run is cut
# short at the step's limit by the build's minutes). Each run's
# evaluation runs TTT_EVAL_WORKERS (3) evaluations side by side (one at a time took 72-91 s a run
# on the H200, a third of the device time). TTT_FLAGS adds flags.
ttt_dir=${TTT_DIR:-build/ttt}
ttt_state=${TTT_STATE:-build/ttt-state}
# runs.jsonl and state.json may come from another folder than the base model's parts: a set that
# spans sessions keeps them in the repository (TTT_RECORD=docs/benchmarks/ttt-h100), where
# a fresh checkout finds them; the base model's 45 MB stay out of git, built again bit-identically
# when lost (benchmarks/base_model.py: its fingerprint is in state.json).
ttt_record=${TTT_RECORD:-$ttt_state}
# runs.jsonl is what counts: a missing state.json is rebuilt from it (the same target, from the run
# that fixed it). A state.json alone travels too: it names the card a set's runs must be timed on
# before the first run, so a call that finds another card refuses instead of starting the set there.
if named ttt; then
  for f in runs.jsonl state.json; do
    [ -f "$ttt_record/$f" ] && mkdir -p "$ttt_dir" && cp "$ttt_record/$f" "$ttt_dir/"
  done
fi
if named ttt && [ ! -f "$ttt_dir/work/base/base.json" ] && [ -f "$ttt_state/base.tar.part-00" ]; then
  mkdir -p "$ttt_dir/work" && cat "$ttt_state"/base.tar.part-* | tar -C "$ttt_dir/work" -xf - \
    || echo "the carried base model did not unpack: it is built again"
fi
# shellcheck disable=SC2086  # TTT_FLAGS: more flags, word by word
named ttt && step ttt "${TTT_LIMIT:-570}" python3 -m benchmarks.time_to_target --preset h200 --out "$ttt_dir" \
  --budget-s "${TTT_BUDGET:-480}" --eval-workers "${TTT_EVAL_WORKERS:-3}" ${TTT_FLAGS:-}
if named ttt; then
  mkdir -p "$out/ttt"
  # At most 8 files come back from a device call (summary.txt and ttt.log among them): the first
  # call's three parts of the base model leave room for runs.jsonl and state.json only; the table
  # and the picture are made again here from runs.jsonl (`--summarize`). A state.json left behind
  # is rebuilt from runs.jsonl (the target from the run that fixed it), but runs.jsonl is the record.
  keep="runs.jsonl state.json summary.md time_to_target.png"
  if [ -f "$ttt_dir/work/base/base.json" ] && [ ! -f "$ttt_state/base.tar.part-00" ]; then
    tar -C "$ttt_dir/work" -cf - base | split -b 15m -d - "$out/ttt/base.tar.part-"
    keep="runs.jsonl state.json"
  fi
  for f in $keep; do
    [ -f "$ttt_dir/$f" ] && cp "$ttt_dir/$f" "$out/ttt/$f"
  done
fi
want modes-sim && step modes-sim 150 python3 -m benchmarks.modes --seeds 1 --steps 4 --max-len 1024 --slots 64 --train-time 3.5 --time-scale 0.1 \
  --only sync --only sync+partial --only async --only "async, overlap" --timeline-dir "$out/timelines"
# The card and versions head the summary (one file less to bring back).
{ cat "$out/gpu.txt"; printf '%s\n' "${status[@]}"; } | tee "$out/summary.txt" && rm -f "$out/gpu.txt"
# The verdicts against issue 34's targets, read from the logs.
{
  grep -h '^target ' "$out/engine.log" 2>/dev/null
  grep -h '^mode ' "$out/modes-builtin.log" 2>/dev/null   # each finished mode, also from a run cut short
  sed -n '/within 10%/,$p' "$out/modes-builtin.log" 2>/dev/null
  # Colocated: the IPC stall verdict, the publish table, the probe's memory table and largest shape.
  grep -h '^target ipc' "$out/colocate-publish.log" 2>/dev/null
  sed -n '/medians of/,/^target/p' "$out/colocate-publish.log" 2>/dev/null
  grep -h -E '^[0-9]+ (passed|failed)|passed|failed' "$out/colocate-tests.log" 2>/dev/null | tail -n 1
  grep -h -E '^engine resident|Error|error:' "$out/colocate-tests.log" 2>/dev/null | head -n 5
  awk '/^colocated on one GPU/{b=""} {b=b $0 "\n"} /^largest/{last=b} END{printf "%s", last}' \
    "$out/colocate-probe.log" 2>/dev/null   # the last table: printed after each shape
  grep -h -E 'passed|failed' "$out/base-check-tests.log" 2>/dev/null | tail -n 1
  grep -h -E '^note:' "$out"/base-check-[12].log 2>/dev/null | head -n 2   # a kernel with no deterministic version
  cat "$out/base-check.txt" 2>/dev/null
  grep -h -E 'passed|failed' "$out/trainer-step-tests.log" 2>/dev/null | tail -n 1
  grep -h -E '^step |^flops estimate' "$out/trainer-step.log" 2>/dev/null
  # Time to target: the base model's check, each run's line, the table, the verdicts, what is left.
  grep -h -E '^base model check|^run |^target fixed' "$out/ttt.log" 2>/dev/null
  cat "$out/ttt/summary.md" 2>/dev/null
} | tee -a "$out/summary.txt"
