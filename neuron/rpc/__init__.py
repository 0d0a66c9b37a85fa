"""The wire between the leader and its workers (no torch here)."""

from neuron.rpc.codec import LineTooLong, decode_reply, decode_request, encode, read_line
from neuron.rpc.protocol import *  # noqa: F401,F403
from neuron.rpc.protocol import Reply, Request

__all__ = ["LineTooLong", "Reply", "Request", "decode_reply", "decode_request", "encode", "read_line"]
