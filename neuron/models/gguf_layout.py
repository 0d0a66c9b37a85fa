"""A GGUF file's layout walked and bounded before the `gguf` package parses it.

GGUF files are untrusted input, and the `gguf` reader trusts every count it meets: an array that
claims 2^40 items in a 4-byte tail makes it loop past the end of the file for hours, nested arrays
recurse without bound, and a tensor whose data lies past the end is mapped as an empty view. This
walk reads each count and length once, checks it against the bytes left in the file and against
limits no real file comes near, and refuses the first that fails in one line naming the file, the
key or tensor, and the byte offset. It reads metadata only: a file of 150k tokens walks in about a
tenth of a second.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from neuron.errors import ConfigError
from neuron.models.config_check import MAX_VOCAB

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type id: bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
MAX_TENSORS = 1 << 17
MAX_FIELDS = 1 << 16
MAX_NAME = 1 << 16  # keys and tensor names
MAX_STRING = 1 << 24  # one string value (a chat template is kilobytes)
MAX_ITEMS = 1 << 24  # one array
MAX_DEPTH = 2  # an array may hold arrays, those arrays not
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 40
# Arrays with one entry per token: a vocabulary past MAX_VOCAB is refused before anything builds it.
_PER_TOKEN = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


class _Walk:
    def __init__(self, data, name: str):
        self.data, self.name, self.at = data, name, 0

    def fail(self, what: str) -> ConfigError:
        return ConfigError(f"{self.name}: {what} (at byte {self.at} of {len(self.data)})")

    def take(self, n: int, what: str) -> int:
        """Skip `n` bytes that must lie inside the file; the offset they start at."""
        if n > len(self.data) - self.at:
            raise self.fail(f"{what} runs past the end of the file")
        at, self.at = self.at, self.at + n
        return at

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.data, self.take(8, what))[0]

    def string(self, what: str, limit: int) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} claims {n} bytes (at most {limit})")
        at = self.take(n, what)
        return bytes(self.data[at:at + n])

    def value(self, kind: int, key: str, depth: int = 0) -> int | None:
        """Skip one value of type `kind`; a u32's value is returned (general.alignment needs it)."""
        if kind in _SCALARS:
            at = self.take(_SCALARS[kind], f"the value of {key}")
            return struct.unpack_from("<I", self.data, at)[0] if kind == _UINT32 else None
        if kind == _STRING:
            self.string(f"the value of {key}", MAX_STRING)
            return None
        if kind != _ARRAY:
            raise self.fail(f"{key} has unknown value type {kind}")
        if depth >= MAX_DEPTH:
            raise self.fail(f"{key} nests arrays more than {MAX_DEPTH} deep")
        item = self.u32(f"the item type of {key}")
        count = self.u64(f"the length of {key}")
        limit = MAX_VOCAB if key in _PER_TOKEN else MAX_ITEMS
        if count > limit:
            what = "tokens" if key in _PER_TOKEN else "items"
            raise self.fail(f"{key} claims {count} {what} (at most {limit})")
        if item in _SCALARS:
            self.take(count * _SCALARS[item], f"the {count} items of {key}")
            return None
        if count > len(self.data) - self.at:  # every string or array item takes at least 8 bytes
            raise self.fail(f"{key} claims {count} items, more than the file has bytes left")
        if item == _STRING:
            self._strings(count, key)
            return None
        for _ in range(count):
            self.value(item, key, depth + 1)
        return None

    def _strings(self, count: int, key: str) -> None:
        """Skip `count` strings: the walk's hot loop (a vocabulary and its merges)."""
        data, at, end, unpack = self.data, self.at, len(self.data), _U64.unpack_from
        for _ in range(count):
            if at + 8 > end:
                break
            n = unpack(data, at)[0]
            if n > MAX_STRING:
                self.at = at
                raise self.fail(f"a string of {key} claims {n} bytes (at most {MAX_STRING})")
            at += 8 + n
        else:
            if at <= end:
                self.at = at
                return
        self.at = min(at, end)
        raise self.fail(f"the strings of {key} run past the end of the file")


def check_layout(path: str | Path) -> None:
    """Refuse a GGUF file whose header, metadata or tensor index is malformed or out of bounds
    (ConfigError naming the file and what was wrong), before anything parses it further."""
    import gguf

    path = Path(path)
    name = path.name
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ConfigError(f"{name}: {size} bytes is too short for a GGUF file")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    try:
        _check(_Walk(data, name), gguf)
    finally:
        data.close()


def _check(w: _Walk, gguf) -> None:
    if bytes(w.data[:4]) != b"GGUF":
        raise w.fail("not a GGUF file (no GGUF magic)")
    w.take(4, "the magic")
    version = w.u32("the version")
    if version not in (2, 3):
        big_endian = struct.unpack(">I", struct.pack("<I", version))[0] in (2, 3)
        raise w.fail("big-endian GGUF files are not supported" if big_endian else f"GGUF version {version} "
                     "is not supported (2 and 3 are)")
    tensors, fields = w.u64("the tensor count"), w.u64("the metadata count")
    if tensors > MAX_TENSORS or fields > MAX_FIELDS:
        raise w.fail(f"claims {tensors} tensors and {fields} metadata keys (at most {MAX_TENSORS} and {MAX_FIELDS})")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    keys = set()
    for _ in range(fields):
        key = w.string("a metadata key", MAX_NAME).decode("utf-8", "replace")
        if key in keys:
            raise w.fail(f"metadata key {key!r} appears twice")
        keys.add(key)
        kind = w.u32(f"the type of {key}")
        value = w.value(kind, key)
        if key == "general.alignment":
            if kind != _UINT32 or not value or value & (value - 1) or value > 1 << 16:
                raise w.fail(f"general.alignment must be a power of two up to 65536 stored as uint32, got {value}")
            alignment = value
    index = [_tensor_info(w, gguf) for _ in range(tensors)]
    start = -(-w.at // alignment) * alignment
    room = len(w.data) - start
    seen = set()
    for tensor, offset, nbytes in index:
        if tensor in seen:
            raise w.fail(f"tensor {tensor!r} appears twice")
        seen.add(tensor)
        if offset % alignment:
            raise w.fail(f"tensor {tensor!r}: its data offset {offset} is not aligned to {alignment} bytes")
        if offset > room or nbytes > room - offset:
            raise w.fail(f"tensor {tensor!r}: its {nbytes} bytes at data offset {offset} run past the end of the file")


def _tensor_info(w: _Walk, gguf) -> tuple[str, int, int]:
    """One tensor's name, data offset and byte size, its shape and type checked."""
    tensor = w.string("a tensor name", MAX_NAME).decode("utf-8", "replace")
    dims = w.u32(f"the dimension count of {tensor!r}")
    if not 1 <= dims <= MAX_DIMS:
        raise w.fail(f"tensor {tensor!r} has {dims} dimensions (1 to {MAX_DIMS})")
    shape = [w.u64(f"the shape of {tensor!r}") for _ in range(dims)]
    kind = w.u32(f"the type of {tensor!r}")
    offset = w.u64(f"the data offset of {tensor!r}")
    elements = 1
    for d in shape:
        if d == 0:
            raise w.fail(f"tensor {tensor!r} has a zero dimension (shape {shape})")
        elements *= d
        if elements > MAX_ELEMENTS:
            raise w.fail(f"tensor {tensor!r} claims shape {shape}, more than {MAX_ELEMENTS} values")
    try:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise w.fail(f"tensor {tensor!r} has unknown type {kind}") from None
    if shape[0] % block:
        raise w.fail(f"tensor {tensor!r}: its rows of {shape[0]} values are not whole blocks of {block}")
    return tensor, offset, elements // block * block_bytes
