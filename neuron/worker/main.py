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
            log.info("stdin closed; exiting")
            worker.close()
            return 0
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
            return 0


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
        return serve(rank, world_size, device, sys.stdin.buffer, stdout)
    except BrokenPipeError:
        return 0
