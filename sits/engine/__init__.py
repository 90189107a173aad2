"""The data plane: one model on one device.

AsyncEngine -> LLMEngine (step loop) -> Scheduler -> BlockPool -> ModelRunner -> Sampler -> Detokenizer.
This package never imports ``sits.runtime`` or ``sits.api``.
"""
