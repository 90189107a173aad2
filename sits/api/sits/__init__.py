"""The SITS dialect: the endpoints OpenAI has no counterpart for. ``/v1/requests`` (``routes``) with
its state machine (``lifecycle``), event log (``request_store``), webhooks and runtime-run tool loop
(``tool_loop``); ``/v1/tools`` (``tool_routes``) and ``/v1/memory`` (``memory_routes``).

What both dialects use (sessions, retrieval, generation, SSE, the bodies) stays in ``sits.api``."""
