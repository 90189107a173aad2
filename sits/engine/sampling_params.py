"""Per-request sampling parameters, validated at the edge so the step loop never sees bad values."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from sits.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Numerically safe bounds. A positive temperature below MIN_TEMPERATURE is raised to it (as vLLM
# does): logits / 5e-324 overflow float32 to inf and the distribution becomes NaN. A repetition
# penalty below MIN_REPETITION_PENALTY is refused: it divides a logit, and a tiny one rounds to 0.
MIN_TEMPERATURE = 1e-2
MIN_REPETITION_PENALTY = 1e-2


@dataclass(slots=True)
class SamplingParams:
    """How to turn logits into tokens for one request.

    ``temperature == 0`` means greedy; a positive one below ``MIN_TEMPERATURE`` is raised to it (close to
    greedy, and finite). ``top_k <= 0`` disables top-k. ``logprobs`` = number of top
    alternatives to return per token (``None``: none, ``0``: only the chosen token's logprob).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: str | None = None           # constrained decoding (see sits.engine.guided); None: free
    grammar_prefix: list[int] = field(default_factory=list)   # tokens already produced under it (a resumed stream)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param, code="invalid_parameter")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, kind in (("max_tokens", int), ("top_k", int)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, f"must be an integer, got {type(v).__name__}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, f"must be a number, got {type(v).__name__}")
            setattr(self, name, float(v))
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"must be in [0, 2], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, 10], got {self.repetition_penalty}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer")
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int):
                raise bad("logprobs", "must be an integer")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", "at most 16 stop strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise bad("grammar", "must be a non-empty string (made by sits.engine.guided)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a plain dict; an unknown key is an error (the engine API is strict)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; allowed: {', '.join(sorted(known))}",
                param=unknown[0], code="unknown_parameter")
        return cls(**d)
