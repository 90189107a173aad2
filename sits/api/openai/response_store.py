"""Stored responses of the Responses API: what ``GET /v1/responses/{id}`` reads and what
``previous_response_id`` continues from.

Kept in this server's memory, newest last, at most ``max_entries`` (the oldest go first), as vLLM
keeps them: a restart or another gateway does not see them. Each entry holds the response object
as it was answered and the conversation it ends (its input and output as chat messages, without
its instructions, which OpenAI does not carry over either). Entries are kept under the tenant's
namespace (``Principal.scoped``): another tenant's response id is not found.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sits.tenancy.principal import scoped


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        key = scoped(response["id"])
        self._entries[key] = StoredResponse(response, conversation)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(scoped(response_id))

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(scoped(response_id), None) is not None

    def __len__(self) -> int:
        return len(self._entries)
