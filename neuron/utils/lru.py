"""A least-recently-used map bounded by the bytes of what it holds (and, if asked, by a count): the
caches a client or a model file can grow (stored responses, adapters' host copies, image
embeddings) are bounded by what they weigh, not only by how many."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """Values by key, each with the size its caller gives; the least recently used are evicted
    until the sizes sum to at most `max_bytes` and (if given) at most `max_count` entries remain.
    Not thread-safe: each user holds one from one thread."""

    def __init__(self, max_bytes: int, max_count: int | None = None):
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.nbytes = 0
        self.entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: K) -> bool:
        return key in self.entries

    def get(self, key: K) -> V | None:
        """The value, now the most recently used; None when it was never kept or is evicted."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, size: int) -> bool:
        """Keep `value` (replacing the key's old one), evicting the least recently used until the
        bounds hold; False, and nothing changed, when it alone would break one."""
        if size > self.max_bytes or self.max_count == 0:
            return False
        self.pop(key)
        self.entries[key] = (value, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes or (self.max_count is not None and len(self.entries) > self.max_count):
            _, (_, evicted) = self.entries.popitem(last=False)
            self.nbytes -= evicted
        return True

    def pop(self, key: K) -> bool:
        """Forget the key's value; False when none was kept."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self.nbytes -= entry[1]
        return True
