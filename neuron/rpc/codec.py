"""Encoding, decoding and bounded line reading for the wire protocol."""

from __future__ import annotations

from typing import BinaryIO

import msgspec

from neuron.config import settings
from neuron.rpc.protocol import REPLY_OPS, REQUEST_OPS, Error, ErrorKind, Reply, Request

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(Request)
_reply_decoder = msgspec.json.Decoder(Reply)
_loose_decoder = msgspec.json.Decoder()
# msgspec raises RecursionError, not DecodeError, on deeply nested input such as "[[[[...", and
# UnicodeDecodeError on a string holding bytes that are not UTF-8.
_UNDECODABLE = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)


def max_line_bytes() -> int:
    return settings().max_line_bytes


def encode(msg: msgspec.Struct) -> bytes:
    """One protocol line, newline included."""
    return _encoder.encode(msg) + b"\n"


class LineTooLong(Exception):
    """A line exceeded the limit; it was consumed up to its newline without being stored."""


def read_line(stream: BinaryIO, limit: int) -> bytes | None:
    """Read one line of at most `limit` bytes. None at EOF; LineTooLong after skipping an oversized
    line, so memory never grows past `limit` whatever the peer sends."""
    line = stream.readline(limit + 1)
    if not line:
        return None
    if len(line) <= limit or line.endswith(b"\n"):
        return line
    while True:  # drain the rest of the oversized line in bounded chunks
        rest = stream.readline(limit + 1)
        if not rest or rest.endswith(b"\n"):
            raise LineTooLong(f"line longer than {limit} bytes")


def _seq_of(obj: object) -> int:
    if isinstance(obj, dict):
        seq = obj.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool):
            return seq
    return -1


def decode_request(line: bytes) -> Request | Error:
    """Decode a request, or describe why it cannot be: `bad_request` for anything undecodable,
    `unknown_op` (with its seq) for a well-formed object whose op we do not speak."""
    try:
        return _request_decoder.decode(line)
    except _UNDECODABLE as exc:
        try:
            loose = _loose_decoder.decode(line)
        except _UNDECODABLE:
            return Error(seq=-1, kind=ErrorKind.BAD_REQUEST, message=f"undecodable line: {exc}")
        seq = _seq_of(loose)
        op = loose.get("op") if isinstance(loose, dict) else None
        if isinstance(op, str) and op not in REQUEST_OPS:
            return Error(seq=seq, kind=ErrorKind.UNKNOWN_OP, message=f"unknown op {op!r}")
        return Error(seq=seq, kind=ErrorKind.BAD_REQUEST, message=f"invalid request: {exc}")


def decode_reply(line: bytes) -> Reply | None:
    """Decode a worker reply; None for a line that is not one (the caller logs and skips it)."""
    try:
        return _reply_decoder.decode(line)
    except _UNDECODABLE:
        return None


__all__ = [
    "LineTooLong",
    "REPLY_OPS",
    "decode_reply",
    "decode_request",
    "encode",
    "max_line_bytes",
    "read_line",
]
