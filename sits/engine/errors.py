"""Typed errors with stable codes: what reaches a user says what went wrong and what to change."""

from __future__ import annotations


class SitsError(Exception):
    """Base of every error SITS reports to a caller.

    ``code`` is stable and machine-readable (clients switch on it); ``param`` names the offending
    input field when there is one; ``http_status`` is what the HTTP layer answers with.
    """

    code = "internal_error"
    http_status = 500
    retry_after_s: int | None = None      # when set, the caller may retry after this many seconds
    headers: dict[str, str] | None = None  # more response headers (e.g. x-ratelimit-* on a 429)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict:
        return {"message": self.message, "type": type(self).__name__, "param": self.param, "code": self.code}


class InvalidRequestError(SitsError):
    """The request itself is wrong (bad parameter, empty prompt, ...)."""

    code = "invalid_request"
    http_status = 400


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class UnsupportedModelError(SitsError):
    """The model directory holds an architecture or a file layout SITS cannot run."""

    code = "unsupported_model"
    http_status = 400


class ModelLoadError(SitsError):
    code = "model_load_failed"
    http_status = 500


class InsufficientDeviceMemoryError(SitsError):
    """The device has too little free memory for the engine's KV pool (an engine start fails)."""

    code = "insufficient_memory"
    http_status = 503


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request_id"
    http_status = 409


class RequestAbortedError(SitsError):
    code = "cancelled"
    http_status = 499


class EngineDeadError(SitsError):
    code = "engine_dead"
    http_status = 503


class EngineStepError(SitsError):
    """A step failed unexpectedly (a bug or a device error): its requests end, the engine serves on."""

    code = "internal_error"
    http_status = 500


class NonFiniteLogitsError(SitsError):
    """The model gave this request logits with no finite distribution (NaN or overflow): its
    sampled token would be meaningless, so the request ends instead."""

    code = "non_finite_logits"
    http_status = 500
