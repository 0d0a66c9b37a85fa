"""The Responses API's memory: responses kept by id for `GET /v1/responses/{id}` and for the
requests that continue them (`previous_response_id`), bounded by count and by bytes, the least
recently used evicted first. Held by the event loop alone, so it needs no lock."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as its JSON (`body`, what GET returns) and the conversation it ends (`history`:
    the JSON list of chat messages a request continuing it starts from)."""

    body: bytes
    history: bytes

    @property
    def size(self) -> int:
        return len(self.body) + len(self.history)


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry`, evicting the least recently used until both bounds hold; False (and nothing
        kept) when it alone would break one."""
        if self.max_count == 0 or entry.size > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when it was never kept or is evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
