"""`neuron --worker --rank N --tp-size W`: one rank behind stdin/stdout.

stdout carries protocol lines only (anything else printed goes to stderr); logs go to stderr
prefixed with the rank. The worker exits 0 on `shutdown` or stdin EOF and never because of one
bad line. It also exits when its leader dies, so no worker outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from neuron.rpc import codec
from neuron.rpc import protocol as p
from neuron.utils.log import setup_logging

log = logging.getLogger("neuron.worker.main")


def _die_with_parent() -> None:
    """Ask Linux to send SIGKILL when the leader exits, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError as exc:
        log.warning("cannot tie worker lifetime to the leader: %s", exc)


def serve(rank: int, world_size: int, device: str, stdin, stdout) -> int:
    _session(rank, world_size, device, stdin, stdout)
    return 0


def _session(rank: int, world_size: int, device: str, stdin, stdout) -> bool:
    """Answer requests until `shutdown` (True) or the end of the input (False)."""
    from neuron.worker.worker import Worker  # imports torch; the pipe is already ours

    worker = Worker(rank, world_size, device)
    limit = codec.max_line_bytes()
    log.info("worker ready (world_size=%d, device=%s, pid=%d)", world_size, device, os.getpid())
    while True:
        try:
            line = codec.read_line(stdin, limit)
        except codec.LineTooLong as exc:
            _send(stdout, p.Error(seq=-1, kind=p.ErrorKind.LINE_TOO_LONG, message=str(exc)))
            continue
        if line is None:
            log.info("input closed")
            worker.close()
            return False
        if not line.strip():
            continue
        req = codec.decode_request(line)
        if isinstance(req, p.Error):
            log.warning("rejected line: %s", req.message)
            _send(stdout, req)
            continue
        _send(stdout, worker.execute(req)[0])
        if isinstance(req, p.Shutdown):
            worker.close()
            return True


def _send(stdout, msg) -> None:
    stdout.write(codec.encode(msg))
    stdout.flush()


def main(rank: int, world_size: int, device: str) -> int:
    setup_logging(f"[rank {rank}] ")
    _die_with_parent()
    stdout = sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must never corrupt the protocol stream
    # Ctrl-C and a process-group SIGTERM reach the leader too, which drains its requests and then
    # shuts us down; we still die with it (stdin EOF, PR_SET_PDEATHSIG) and to SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        code = serve(rank, world_size, device, sys.stdin.buffer, stdout)
    except BrokenPipeError:
        code = 0
    # The session closed what it holds (the models, the communicator, shared segments); what is
    # left is the interpreter's own teardown, which with torch loaded took 0.5 s of every shutdown,
    # unload and rebuild of a tp > 1 engine. Leave without it.
    sys.stderr.flush()
    os._exit(code)


def main_connect(address: str, rank: int, world_size: int, device: str) -> int:
    """`neuron --worker --connect LEADER:PORT`: dial the leader and serve over TCP; dial again
    when the leader closes the connection (it rebuilds its ranks), exit on `shutdown`, on refusal
    or when the leader cannot be reached within the worker start deadline."""
    from neuron.config import settings
    from neuron.rpc.dial_in import Refused, cluster_token, dial

    setup_logging(f"[rank {rank}] ")
    sys.stdout = sys.stderr  # nothing printed may look like a protocol line
    s = settings()
    token = cluster_token(s.cluster_token, s.cluster_token_file)
    while True:
        try:
            sock, reader = dial(address, rank, token, s.worker_start_timeout_s)
        except Refused as exc:
            log.error("the leader at %s refused this rank: %s", address, exc)
            return 2
        except OSError as exc:
            log.error("cannot reach the leader at %s: %s", address, exc)
            return 1
        log.info("connected to the leader at %s", address)
        try:
            done = _session(rank, world_size, device, reader, sock.makefile("wb"))
        except OSError:  # the connection broke under a reply
            done = False
        finally:
            sock.close()
        if done:
            return 0
        log.info("the leader closed the connection; dialling again")
