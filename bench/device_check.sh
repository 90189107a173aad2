#!/usr/bin/env bash
# The checks that need a GPU, as one short command for a GPU host that has torch (and transformers)
# installed but cannot reach a package index.
#
#   bench/device_check.sh fetch   # on a host where pip works: the wheels the engine needs beyond
#                                 # what such a GPU image holds, into .whl/ (add .whl/ to .git/info/exclude)
#   bench/device_check.sh run     # on the GPU host: tests/test_cuda.py on the device and the CPU parity
#                                 # tests against that host's transformers, then `sits bench engine
#                                 # --device cuda` in fp32 and bf16 on the small preset
#
# `run` writes its logs, the benchmark's JSON and its markdown section under $OUT (default
# bench/out/device). It installs nothing into the host's Python: the wheels go to /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."

# The engine's imports beyond torch, numpy, safetensors, tokenizers, jinja2, xxhash and attrs
# (versions as pinned by this project's lock of the day; cp312 wheels for x86-64 Linux).
WHEELS=(llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
        rpds-py==2026.9.1)

case "${1:-run}" in
fetch)
    py=.venv/bin/python; [ -x "$py" ] || py=python3
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    ls -la .whl
    ;;
run)
    OUT="${OUT:-bench/out/device}"
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site:$PWD"
    fi
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
      python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'; } \
        2>&1 | tee "$OUT/host.txt"
    status=0
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py tests/test_model_parity.py \
        2>&1 | tee "$OUT/tests.log" || status=1
    python3 -c 'from sits.modelbuild.tiny import build_tiny_model; build_tiny_model("/tmp/sits-small", preset="small", seed=0)'
    for dtype in float32 bfloat16; do
        python3 -m sits.cli bench engine --model /tmp/sits-small --device cuda --dtype "$dtype" --repeats 3 \
            --json "$OUT/engine_cuda_$dtype.json" --write-docs "$OUT/benchmarks_cuda_$dtype.md" \
            2>&1 | tee "$OUT/engine_cuda_$dtype.log" || status=1
    done
    exit "$status"
    ;;
*)
    echo "usage: $0 fetch|run" >&2
    exit 2
    ;;
esac
