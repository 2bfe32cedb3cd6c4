#!/usr/bin/env bash
# Prepare what the H200 machine (Python 3.12, torch 2.11 cu130 on the image) lacks for the
# megatron GPU tests: the project's pure-Python deps as cp312 wheels plus megatron-core 0.19.2.
# Uses the shared tool when it is there (../tools/gpu-wheels.sh, see reference/environment.md),
# else downloads the same list itself. DIR must be git-ignored (.git/info/exclude) and carried.
#
#   bash benchmarks/gpu_wheels.sh .wheels-gpu
# then on the device (carry [".wheels-gpu"]):
#   pip install -q --no-index --no-deps --target /tmp/site .wheels-gpu/*.whl && \
#   PYTHONPATH=/tmp/site:. python -m pytest -q -p no:cacheprovider -m gpu tests/test_megatron_gpu.py tests/test_gpu.py -s
set -euo pipefail
dir=${1:-.wheels-gpu}
here=$(cd "$(dirname "$0")/.." && pwd)
tool=""
for candidate in "$here/../../shared/tools/gpu-wheels.sh" "$here/../tools/gpu-wheels.sh" "/work/shared/tools/gpu-wheels.sh"; do
  [ -f "$candidate" ] && tool=$candidate && break
done
if [ -n "$tool" ]; then
  bash "$tool" "$dir" megatron-core==0.19.2
else
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" anyio aiohttp aiohappyeyeballs aiosignal attrs frozenlist \
    multidict propcache yarl idna sniffio orjson msgpack lmdb structlog hypothesis sortedcontainers pytest \
    pluggy iniconfig typing_extensions megatron-core==0.19.2
fi
ls "$dir" | wc -l
