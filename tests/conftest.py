"""Shared fixtures: a real tiny model directory built once per session (random weights, seeded)."""

from __future__ import annotations

import os

import pytest
import torch

from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.models.tiny import build_tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_model(path, preset="tiny", seed=0, progress=None)
    return str(path)


@pytest.fixture
def make_engine(tiny_model_dir):
    """Factory for engines on the tiny model; small KV pool and no warm-up unless asked."""

    def make(**kw) -> LLMEngine:
        kw.setdefault("device", "cpu")
        kw.setdefault("warmup", False)
        kw.setdefault("kv_cache_memory_mb", 32)
        return LLMEngine(EngineConfig(model=tiny_model_dir, **kw))

    return make


def dense_greedy(engine: LLMEngine, prompt_ids: list[int], n: int) -> list[int]:
    """Reference decode without any cache: re-run the whole sequence each token."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(engine.model.forward_dense(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]
