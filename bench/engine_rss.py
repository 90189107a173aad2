"""Resident memory of a CPU engine just started (fp32, no warm-up), to compare checkouts:

    PYTHONPATH=/tmp/old .venv/bin/python bench/engine_rss.py MODEL_DIR
    PYTHONPATH=. .venv/bin/python bench/engine_rss.py MODEL_DIR
"""

import gc
import sys

from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine

engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", warmup=False, kv_cache_memory_mb=64))
gc.collect()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
merged = engine.model.model.layers[0].self_attn.qkv_proj is not None
print(f"VmRSS {status['VmRSS'].strip()}, RssAnon {status['RssAnon'].strip()}, projections merged: {merged}")
