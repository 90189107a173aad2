"""The OpenAI dialect: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (``routes``),
``/v1/embeddings`` (``embedding_routes``), and ``tools`` / ``response_format`` as a grammar with the
answer read back as ``tool_calls`` (``structured``)."""
