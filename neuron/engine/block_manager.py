"""KV block allocation, on the leader: which blocks of the ranks' pools each sequence owns.

Ranks store block tables and nothing else; every decision is made here. With prefix caching, a
full block is named by a hash chain (its parent block's hash and its own token ids), so a later
sequence whose tokens start the same way takes the blocks already computed instead of
recomputing them. A request's cache salt (`Sequence.cache_salt`) is its first block's parent, so
the whole chain of a salted request differs from that of any other salt or of none: requests
share blocks only when their salts match. Only full blocks are shared and nothing writes to a full
block again, so no copy-on-write is needed; a sequence's last, partial block is always its own. A cached block that
no sequence uses any more stays evictable, least recently freed first, until it is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neuron.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class Block:
    id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is in the prefix cache


def chain_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """A full block's name: its tokens and, through the parent's name, every token before them
    (and the request's salt, the first block's parent)."""
    return hashlib.sha256((parent or b"") + array("q", token_ids).tobytes()).digest()


# What a salt's digest starts from. It cannot name a block: a first block hashes token ids, each
# below the vocabulary size, whose 8 bytes never spell this text; a later block's parent would
# have to be a hash beginning with it.
_SALT_DOMAIN = b"neuron cache_salt\0"


def salt_key(salt: str | None) -> bytes | None:
    """What a request's cache salt adds to its first block's hash: a digest, so the salt itself is
    never kept (nor shown in a repr or a log)."""
    if salt is None:
        return None
    # surrogatepass: a Python string may hold a lone surrogate (a JSON body cannot)
    return hashlib.sha256(_SALT_DOMAIN + salt.encode("utf-8", "surrogatepass")).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unused and holding nothing worth keeping, taken from the end: the block freed last goes out
        # first, and untouched ones in id order after those. A CPU pool's pages become resident as
        # blocks are first written, so reusing freed blocks keeps its memory at what the sequences
        # and the prefix cache hold (and the blocks warm in the CPU's caches), where handing out the
        # oldest would walk the whole pool, faulting in and zeroing fresh pages until all of it were
        # resident.
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unused but cached; evicted from the front
        self.cached: dict[bytes, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def usage(self) -> float:
        """Fraction of blocks some sequence holds (cached but unused blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- sequences ----

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, its longest cached prefix first
        (`seq.num_cached_blocks` of them, already computed). Returns False, changing nothing,
        when too few blocks are free."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        new = self.blocks_for(seq.num_tokens) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # leave the free count
        if new + reclaimed > self.num_free:
            return False
        for b in hits:
            self._take(b)
        seq.block_table = hits + [self._new_block() for _ in range(new)]
        seq.num_cached_blocks = len(hits)
        return True

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence's next token finds room (in its last block or a free one)."""
        return self._missing(seq) <= self.num_free

    def append(self, seq: Sequence) -> None:
        """Add the block the sequence's next token needs, if it needs one."""
        for _ in range(self._missing(seq)):
            seq.block_table.append(self._new_block())

    def reserve(self, seq: Sequence, positions: int) -> int:
        """Blocks for the sequence's first `positions` positions, as far as free blocks go (its
        speculative tokens); the positions its blocks cover now."""
        while self.blocks_for(positions) > len(seq.block_table) and self.num_free > 0:
            seq.block_table.append(self._new_block())
        return len(seq.block_table) * self.block_size

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's claim on its blocks; cached ones stay reusable until evicted."""
        for b in reversed(seq.block_table):  # the tail of a prefix goes before its head
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} released twice"
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[b] = None
                else:
                    self.free.append(b)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def cache_computed(self, seq: Sequence) -> None:
        """Enter the sequence's newly full and computed blocks into the prefix cache. Not those of
        a sequence with images: its placeholder tokens do not say which image filled them."""
        if not self.enable_prefix_caching or seq.images:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        if seq.num_cached_blocks >= full:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:  # else an equal block is already cached
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.id
        seq.num_cached_blocks = full

    def computing_elsewhere(self, seq: Sequence, others: list[Sequence]) -> bool:
        """Whether the first of the sequence's full blocks that the prefix cache lacks is being
        computed right now by one of `others` (the same tokens up to the end of that block). The
        sequence then waits, and takes the block from the cache once it is there instead of
        computing it a second time: the samples of one prompt prefill it once."""
        if not self.enable_prefix_caching or seq.images or seq.wants_every_prompt_row:
            return False
        k = len(self._cached_prefix(seq))
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        if k == len(hashes):
            return False  # nothing more to share
        end = (k + 1) * self.block_size
        return any(len(o.block_hashes) > k and o.block_hashes[k] == hashes[k] and o.num_computed < end
                   for o in others)

    # ---- internals ----

    def _missing(self, seq: Sequence) -> int:
        return max(0, self.blocks_for(seq.num_tokens) - len(seq.block_table))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached run of the sequence's full blocks; at least one token
        is always left to compute, since its logits (or its last-token embedding) are needed. None
        for a sequence that wants every prompt row (its logprobs, a mean pooling): a cached prefix
        would skip the rows they come from."""
        if not self.enable_prefix_caching or seq.images or seq.wants_every_prompt_row:
            return []
        hits = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """The hash chain of the sequence's first `n` full blocks (kept on the sequence)."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), n):
            parent = hashes[-1] if hashes else seq.cache_salt
            hashes.append(chain_hash(parent, seq.token_slice(i * bs, (i + 1) * bs)))
        return hashes[:n]

    def _take(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref_count == 0:
            del self.evictable[b]
        block.ref_count += 1

    def _new_block(self) -> int:
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.evictable.popitem(last=False)
            block = self.blocks[b]
            del self.cached[block.hash]
            block.hash = None
        self.blocks[b].ref_count = 1
        return b
