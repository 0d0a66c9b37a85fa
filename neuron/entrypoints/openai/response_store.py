"""The Responses API's memory: responses kept by id for `GET /v1/responses/{id}` and for the
requests that continue them (`previous_response_id`), bounded by count and by bytes, the least
recently used evicted first. Each entry belongs to an owner: under --prefix-cache-isolation api-key,
a digest of the key its request presented, so that a client sees (continues, reads, deletes) only
the responses made with its own key; "" otherwise. Held by the event loop alone, so it needs no
lock."""

from __future__ import annotations

from dataclasses import dataclass

from neuron.utils.lru import SizedLRU


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
        self._entries: SizedLRU[tuple[str, str], StoredResponse] = SizedLRU(max_bytes, max_count)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._entries.nbytes

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry`, evicting the least recently used until both bounds hold; False (and nothing
        kept) when it alone would break one."""
        return self._entries.put((owner, response_id), entry, entry.size)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """`owner`'s entry, now the most recently used; None when it was never kept, is evicted, or
        is another owner's."""
        return self._entries.get((owner, response_id))

    def delete(self, owner: str, response_id: str) -> bool:
        return self._entries.pop((owner, response_id))


@dataclass(frozen=True, slots=True)
class OwnedResponses:
    """One owner's part of a ResponseStore: what a request's handlers keep, read and delete."""

    store: ResponseStore
    owner: str

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        return self.store.put(self.owner, response_id, entry)

    def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(self.owner, response_id)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(self.owner, response_id)
