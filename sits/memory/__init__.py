"""State that outlives a request: conversation sessions (and, later, vector memory).

Cross-cutting (DESIGN.md): the HTTP layer reads and writes it; it imports neither ``api`` nor
``runtime``.
"""
