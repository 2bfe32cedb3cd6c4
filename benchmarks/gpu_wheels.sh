#!/usr/bin/env bash
# Prepare what the H200 machine (Python 3.12, torch 2.11 cu130 on the image) lacks for the
# megatron GPU tests: the project's pure-Python deps as cp312 wheels plus megatron-core 0.19.2,
# and torch-memory-saver 0.0.10 for --colocate (2.6 MB: its CUDA 12 and 13 hook libraries).
# The GPU image already has torch, transformers, numpy, safetensors, tokenizers, tqdm and triton.
# DIR must be git-ignored (.git/info/exclude) and carried to the GPU host.
#
#   bash benchmarks/gpu_wheels.sh .wheels-gpu
# then on the device (carry [".wheels-gpu"]):
#   pip install -q --no-index --no-deps --target /tmp/site .wheels-gpu/*.whl && \
#   PYTHONPATH=/tmp/site:. python -m pytest -n 0 -q -p no:cacheprovider -m gpu tests/test_megatron_gpu.py tests/test_gpu.py -s
set -euo pipefail
dir=${1:-.wheels-gpu}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" anyio aiohttp aiohappyeyeballs aiosignal attrs frozenlist \
  multidict propcache yarl idna sniffio orjson msgpack lmdb structlog hypothesis sortedcontainers pytest \
  pluggy iniconfig pytest-timeout pytest-xdist execnet typing_extensions megatron-core==0.19.2 \
  torch-memory-saver==0.0.10
ls "$dir" | wc -l
