#!/usr/bin/env bash
# The checks that need a GPU, as one short command for a GPU host that has torch (and transformers)
# installed but cannot reach a package index.
#
#   bench/device_check.sh fetch   # on a host where pip works: the wheels the engine needs beyond
#                                 # what such a GPU image holds, into .whl/ (add .whl/ to .git/info/exclude)
#   bench/device_check.sh run     # on the GPU host, within DEVICE_CHECK_SECONDS (default 500):
#                                 # tests/test_cuda.py on the device and the parity tests against that
#                                 # host's transformers; `sits bench step` (reference vs paged kernels vs
#                                 # + CUDA graphs, against HF generate) on the base preset (bf16), a
#                                 # Llama-3.2-1B-shaped random checkpoint (bf16) and small (fp32);
#                                 # `sits bench coldstart --no-server` on the 1B shape; `sits bench engine`
#                                 # bursty + prefix and `sits bench lora` on base
#
# `run` writes its logs, each benchmark's JSON and markdown, and all of them in device_check.json and
# device_check.md, under $OUT (default bench/out/device). It installs nothing into the host's Python:
# the wheels go to /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."

# The engine's imports beyond torch, numpy, safetensors, tokenizers, jinja2, xxhash and attrs, and the
# zygote's and instance client's (msgspec, pydantic) for `sits bench standby` (versions as pinned by
# this project's lock of the day; cp312 wheels for x86-64 Linux).
WHEELS=(llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
        rpds-py==2026.9.1 msgspec==0.23.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing-extensions==4.16.0)

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
    PY="${PYTHON:-python3}"              # the GPU image's python3 holds torch
    DEV="${DEVICE_CHECK_DEVICE:-cuda}"   # cpu + DEVICE_CHECK_QUICK=1: a dry run of this script (tests/test_device_check.py)
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
    if compgen -G ".whl/*.whl" >/dev/null; then
        # (cp312 wheels: a dry run on another python has its own packages, and says so)
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                .whl/*.whl 2>"$OUT/wheels.log"; then
            export PYTHONPATH="/tmp/site:$PWD"
        else
            echo "wheels from .whl not installed (see wheels.log)"
        fi
    fi
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
      "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || true
      # what the gateway budgets each GPU from: NVML, read without a CUDA context
      "$PY" -c 'from sits.runtime.device_memory import gpu_memory as g; print("nvml (free, total) bytes:", g())' \
          || true; } \
        2>&1 | tee "$OUT/host.txt"
    status=0
    # everything within DEVICE_CHECK_SECONDS (default 500: the device's per-command limit is 600); a
    # step that would start with under a minute left is skipped and named in skipped.txt
    deadline=$((SECONDS + ${DEVICE_CHECK_SECONDS:-500}))
    left() { echo $((deadline - SECONDS - 15)); }
    # 1. correctness on the device: the CUDA tests (paged kernels, decode graphs, sampling on the device)
    #    and the CPU parity tests against this host's transformers
    SITS_TEST_DEVICE="$DEV" timeout 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py \
        tests/test_model_parity.py 2>&1 | tee "$OUT/tests.log" || status=1
    # 2. models: the presets, and a random checkpoint shaped like Llama-3.2-1B (weights drawn on the GPU);
    #    a dry run uses the tiny preset for all three
    build_models() {      # a failure is recorded, and the benchmarks that need the model fail on their own
        if [ -n "${DEVICE_CHECK_QUICK:-}" ]; then
            "$PY" -c 'from sits.modelbuild.tiny import build_tiny_model as b; b("'"$BASE"'", overwrite=True, progress=None)' \
                || return 1
        else
            "$PY" -c 'from sits.modelbuild.tiny import build_tiny_model as b
for preset in ("small", "base"): b(f"/tmp/sits-{preset}", preset=preset, seed=0, progress=None, overwrite=True)' \
                || return 1
            "$PY" -m sits.cli model build-shaped "$L1B" --shape llama-3.2-1b --device "$DEV" || return 1
        fi
    }
    if [ -n "${DEVICE_CHECK_QUICK:-}" ]; then
        SMALL=/tmp/sits-check-tiny BASE=/tmp/sits-check-tiny L1B=/tmp/sits-check-tiny
    else
        SMALL=/tmp/sits-small BASE=/tmp/sits-base L1B=/tmp/sits-llama1b
    fi
    build_models 2>&1 | tee "$OUT/models.log" || status=1
    bench() {
        local name=$1 limit=$(($2 * ${DEVICE_CHECK_CAP_SCALE:-1})); shift 2   # a CPU dry run scales the caps
        local t; t=$(left); [ "$t" -lt "$limit" ] || t=$limit
        if [ "$t" -lt 60 ]; then echo "$name: skipped, ${t}s left" | tee -a "$OUT/skipped.txt"; return; fi
        timeout "$t" "$PY" -m sits.cli bench "$@" --json "$OUT/$name.json" --write-docs "$OUT/$name.md" \
            2>&1 | tee "$OUT/$name.log" || status=1
    }
    # 3. the decode step per attention path (reference, paged, paged+graphs) against HF generate
    bench step_base_bf16 100 step --model "$BASE" --device "$DEV" --dtype bfloat16 --batch-sizes 1,32 --repeats 2
    bench step_llama1b_bf16 100 step --model "$L1B" --device "$DEV" --dtype bfloat16 --batch-sizes 1,32 \
        --repeats 1 --steps 48
    # 4. zero instances -> first token for the 1B shape: an engine forked as the zygote forks one
    #    (the HTTP stack's packages are not on the GPU image), against a fresh transformers process
    bench coldstart_llama1b_bf16 100 coldstart --model "$L1B" --device "$DEV" --dtype bfloat16 --no-server \
        --warmup false --repeats 2
    # 4b. an instance start from the runtime's zygote: forked vs handed to a standby process (its CUDA
    #     context made before the start is asked for), alternating
    bench standby_llama1b_bf16 70 standby --model "$L1B" --device "$DEV" --dtype bfloat16 --repeats 2
    # 5. bursty PF-SD vs FCFS and the prefix cache, with the GPU's 2048-token step budget
    bench engine_base_bf16 110 engine --model "$BASE" --device "$DEV" --dtype bfloat16 --only bursty \
        --only prefix --repeats 1 ${DEVICE_CHECK_QUICK:+--quick}
    # 6. 8 LoRA adapters mixed in one batch vs one adapter vs one after another
    bench lora_base_bf16 70 lora --model "$BASE" --device "$DEV" --dtype bfloat16 --requests 64 --repeats 2
    # 7. fp32 on the small preset (the issue's first figures were fp32)
    bench step_small_fp32 60 step --model "$SMALL" --device "$DEV" --dtype float32 --batch-sizes 1,32 \
        --repeats 1
    # 8. the Llama-3.1-8B shape when time is left (16 GB written, then read into the zygote's host copy):
    #    an instance start from host RAM, forked vs standby
    if [ -z "${DEVICE_CHECK_QUICK:-}" ]; then
        if [ "$(left)" -ge 240 ]; then
            { "$PY" -m sits.cli model build-shaped /tmp/sits-llama8b --shape llama-3.1-8b --device "$DEV" 2>&1 \
                | tee "$OUT/models8b.log" && \
              bench standby_llama8b_bf16 170 standby --model /tmp/sits-llama8b --device "$DEV" --dtype bfloat16 \
                  --repeats 1; } || status=1
        else
            echo "llama-3.1-8b build and standby bench: skipped, $(left)s left" | tee -a "$OUT/skipped.txt"
        fi
    fi
    # one JSON and one markdown for everything
    "$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "device_check"}
(out / "device_check.json").write_text(json.dumps(parts, indent=2))
host = (out / "host.txt").read_text() if (out / "host.txt").exists() else ""
skipped = (out / "skipped.txt").read_text().strip() if (out / "skipped.txt").exists() else ""
md = ["# Device check\n\n```\n" + host.strip() + "\n```" + (f"\n\nSkipped (out of time):\n\n```\n{skipped}\n```"
                                                             if skipped else "")]
header = "# Benchmarks\n\nEvery figure is a ratio against a baseline measured in the same run."
md += [(out / f"{name}.md").read_text().replace(header, "").strip() for name in parts if (out / f"{name}.md").exists()]
(out / "device_check.md").write_text("\n\n".join(md))
PY
    exit "$status"
    ;;
*)
    echo "usage: $0 fetch|run" >&2
    exit 2
    ;;
esac
