"""Tenants: who is calling (keys, scopes), how much they may do (limits, budgets), what it cost.

The gateway runs every request, so it can account exactly: at admission the worst case of a request
(prompt + max_tokens, priced) is reserved against every limit and budget of its key and tenant in
one step that no other request can interleave with; when the request ends, the actual use is
settled and the rest released. Nothing here imports ``sits.api``; the HTTP layer calls in.
"""
