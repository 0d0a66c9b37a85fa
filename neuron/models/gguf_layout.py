"""A GGUF file's header, metadata and tensor index, read and bounded in one walk.

GGUF files are untrusted input. Each count and length is read once, checked against the bytes
left in the file and against limits no real file comes near (an array that claims 2^40 items in a
4-byte tail, arrays nested without end, a tensor whose data lies past the end), and the first that
fails is refused in one line naming the file, the key or tensor, and the byte offset. Values are
kept as read: strings as bytes (decoded, and refused when they are not UTF-8, where they are used),
numeric arrays as numpy arrays. The walk reads metadata only, and a vocabulary of 150k tokens with
its merges in about a tenth of a second; the `gguf` package's reader took 8 s on the same file.

Tensors stay in the file, mapped, until a rank copies out its slice (`Tensor.data`): dense types
as their own elements (F32, F16, BF16 as 16-bit words), the quantized ones as rows of block bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neuron.errors import ConfigError
from neuron.models.config_check import MAX_VOCAB

# GGUF's value types: id -> (struct format, numpy dtype)
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_SCALAR_FORMATS = {kind: struct.Struct(fmt) for kind, (fmt, _) in _SCALARS.items()}
STRING, ARRAY, UINT32 = 8, 9, 4
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
# dense tensor types as numpy reads their elements (BF16 as its 16-bit words); the rest are block bytes
_ELEMENTS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64,
             30: np.uint16}


@dataclass(frozen=True)
class Field:
    """A metadata value as stored: `kind` is GGUF's value type; `items` the array's item type (-1
    for a single value). Strings are bytes; numeric arrays numpy arrays; arrays of strings or of
    arrays, lists."""
    kind: int
    items: int
    value: object


@dataclass(frozen=True, eq=False)  # compared by identity: a numpy view has no single truth value
class Tensor:
    """One tensor of the index. `shape` in GGUF's order (the fastest-moving dimension first);
    `data` a read-only view of the mapped file."""
    name: str
    kind: int
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    _file: np.ndarray

    @property
    def tensor_type(self):
        import gguf

        return gguf.GGMLQuantizationType(self.kind)

    @property
    def data(self) -> np.ndarray:
        """The tensor in numpy's order: dense types as their elements, quantized ones as one row of
        block bytes per output (the last dimension in bytes)."""
        raw = self._file[self.data_offset:self.data_offset + self.n_bytes]
        dims = tuple(reversed(self.shape))
        if self.kind in _ELEMENTS:
            return raw.view(_ELEMENTS[self.kind]).reshape(dims)
        return raw.reshape(*dims[:-1], -1)


@dataclass(frozen=True)
class Layout:
    fields: dict[str, Field]
    tensors: dict[str, Tensor]


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
        return _U64.unpack_from(self.data, self.take(8, what))[0]

    def string(self, what: str, limit: int) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} claims {n} bytes (at most {limit})")
        at = self.take(n, what)
        return self.data[at:at + n]

    def value(self, kind: int, key: str, depth: int = 0) -> Field:
        if kind in _SCALARS:
            fmt = _SCALAR_FORMATS[kind]
            return Field(kind, -1, fmt.unpack_from(self.data, self.take(fmt.size, f"the value of {key}"))[0])
        if kind == STRING:
            return Field(kind, -1, self.string(f"the value of {key}", MAX_STRING))
        if kind != ARRAY:
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
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            at = self.take(count * dtype.itemsize, f"the {count} items of {key}")
            return Field(kind, item, np.frombuffer(self.data, dtype, count, at).copy())
        if count > len(self.data) - self.at:  # every string or array item takes at least 8 bytes
            raise self.fail(f"{key} claims {count} items, more than the file has bytes left")
        if item == STRING:
            return Field(kind, item, self._strings(count, key))
        if item != ARRAY:
            raise self.fail(f"{key} has unknown item type {item}")
        return Field(kind, item, [self.value(item, key, depth + 1).value for _ in range(count)])

    def _strings(self, count: int, key: str) -> list[bytes]:
        """`count` strings: the walk's hot loop (a vocabulary and its merges)."""
        data, at, end, unpack = self.data, self.at, len(self.data), _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if at + 8 > end:
                break
            n = unpack(data, at)[0]
            if n > MAX_STRING:
                self.at = at
                raise self.fail(f"a string of {key} claims {n} bytes (at most {MAX_STRING})")
            at += 8
            if n > end - at:
                break
            append(data[at:at + n])
            at += n
        else:
            self.at = at
            return out
        self.at = min(at, end)
        raise self.fail(f"the strings of {key} run past the end of the file")


def read_layout(path: str | Path) -> Layout:
    """The GGUF file at `path`: its metadata and tensor index, each count and length bounded; a
    malformed or out-of-bounds file is refused (ConfigError naming the file and what was wrong).
    The file stays mapped while its tensors are referenced."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ConfigError(f"{path.name}: {size} bytes is too short for a GGUF file")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    return _read(_Walk(mapped, path.name), np.frombuffer(mapped, dtype=np.uint8))


def _read(w: _Walk, file: np.ndarray) -> Layout:
    if w.data[:4] != b"GGUF":
        raise w.fail("not a GGUF file (no GGUF magic)")
    w.take(4, "the magic")
    version = w.u32("the version")
    if version not in (2, 3):
        big_endian = struct.unpack(">I", struct.pack("<I", version))[0] in (2, 3)
        raise w.fail("big-endian GGUF files are not supported" if big_endian else f"GGUF version {version} "
                     "is not supported (2 and 3 are)")
    tensors, count = w.u64("the tensor count"), w.u64("the metadata count")
    if tensors > MAX_TENSORS or count > MAX_FIELDS:
        raise w.fail(f"claims {tensors} tensors and {count} metadata keys (at most {MAX_TENSORS} and {MAX_FIELDS})")
    fields: dict[str, Field] = {}
    for _ in range(count):
        key = w.string("a metadata key", MAX_NAME).decode("utf-8", "replace")
        if key in fields:
            raise w.fail(f"metadata key {key!r} appears twice")
        fields[key] = w.value(w.u32(f"the type of {key}"), key)
    import gguf

    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    if (given := fields.get("general.alignment")) is not None:
        value = given.value
        if given.kind != UINT32 or not value or value & (value - 1) or value > 1 << 16:
            raise w.fail(f"general.alignment must be a power of two up to 65536 stored as uint32, got {value!r}")
        alignment = value
    index = [_tensor_info(w) for _ in range(tensors)]
    start = -(-w.at // alignment) * alignment
    room = len(w.data) - start
    out: dict[str, Tensor] = {}
    for name, kind, shape, elements, offset, nbytes in index:
        if name in out:
            raise w.fail(f"tensor {name!r} appears twice")
        if offset % alignment:
            raise w.fail(f"tensor {name!r}: its data offset {offset} is not aligned to {alignment} bytes")
        if offset > room or nbytes > room - offset:
            raise w.fail(f"tensor {name!r}: its {nbytes} bytes at data offset {offset} run past the end of the file")
        out[name] = Tensor(name, kind, shape, elements, nbytes, start + offset, file)
    return Layout(fields, out)


def _tensor_info(w: _Walk) -> tuple[str, int, tuple[int, ...], int, int, int]:
    """One tensor's name, type, shape, element count, data offset and byte size, checked."""
    import gguf

    tensor = w.string("a tensor name", MAX_NAME).decode("utf-8", "replace")
    dims = w.u32(f"the dimension count of {tensor!r}")
    if not 1 <= dims <= MAX_DIMS:
        raise w.fail(f"tensor {tensor!r} has {dims} dimensions (1 to {MAX_DIMS})")
    shape = tuple(w.u64(f"the shape of {tensor!r}") for _ in range(dims))
    kind = w.u32(f"the type of {tensor!r}")
    offset = w.u64(f"the data offset of {tensor!r}")
    elements = 1
    for d in shape:
        if d == 0:
            raise w.fail(f"tensor {tensor!r} has a zero dimension (shape {list(shape)})")
        elements *= d
        if elements > MAX_ELEMENTS:
            raise w.fail(f"tensor {tensor!r} claims shape {list(shape)}, more than {MAX_ELEMENTS} values")
    try:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise w.fail(f"tensor {tensor!r} has unknown type {kind}") from None
    if shape[0] % block:
        raise w.fail(f"tensor {tensor!r}: its rows of {shape[0]} values are not whole blocks of {block}")
    return tensor, kind, shape, elements, offset, elements // block * block_bytes
