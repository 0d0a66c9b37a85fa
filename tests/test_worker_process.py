"""The real worker process behind its pipes: protocol lines on stdout, rank-prefixed logs on stderr,
typed errors for bad input, and a clean exit on `shutdown` or stdin EOF."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

import pytest

from neuron.rpc import codec
from neuron.rpc import protocol as p

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # each worker imports torch before it answers

STARTUP_S = 120.0  # the worker imports torch before it answers
REPLY_S = 30.0
MAX_LINE = 4096


class WorkerProcess:
    """`neuron --worker --rank 1 --tp-size 2` with its output read on background threads."""

    def __init__(self):
        env = {**os.environ, "NEURON_MAX_LINE_BYTES": str(MAX_LINE), "NEURON_NUM_THREADS": "1",
               "NEURON_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "neuron", "--worker", "--rank", "1", "--tp-size", "2", "--device", "cpu"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env)
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.stdout: list[bytes] = []
        self.stderr: list[str] = []
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.stdout.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self.stderr.append(line.decode("utf-8", "replace"))

    def send_raw(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def ask(self, data: bytes | p.Message, timeout: float = REPLY_S) -> p.Reply:
        self.send_raw(codec.encode(data) if isinstance(data, p.Message) else data)
        line = self.lines.get(timeout=timeout)
        assert line is not None, f"worker exited: {self.proc.wait(5)}; stderr: {''.join(self.stderr[-20:])}"
        reply = codec.decode_reply(line)
        assert reply is not None, f"not a protocol line: {line[:200]!r}"
        return reply

    def finish_output(self) -> None:
        for t in self._threads:
            t.join(timeout=10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def worker():
    w = WorkerProcess()
    assert w.ask(p.Ping(seq=1), timeout=STARTUP_S) == p.Pong(seq=1, rank=1, world_size=2, device="cpu")
    yield w
    w.kill()


def test_ping(worker):
    reply = worker.ask(b'{"op":"ping","seq":7}\n')
    assert (type(reply), reply.seq, reply.rank, reply.world_size) == (p.Pong, 7, 1, 2)
    assert reply.protocol == p.PROTOCOL_VERSION


def test_unknown_op(worker):
    reply = worker.ask(b'{"op":"teleport","seq":8}\n')
    assert (type(reply), reply.kind, reply.seq) == (p.Error, p.ErrorKind.UNKNOWN_OP, 8)


@pytest.mark.parametrize("line", [b"this is not json\n", b"\xff\xfe\x00\n", b"[1,2,3]\n",
                                  b'{"op":"ping","seq":9,"x":' + b"[" * 2000 + b"]" * 2000 + b"}\n"],
                         ids=["text", "binary", "array", "deeply-nested"])
def test_garbage_is_bad_request(worker, line):
    assert len(line) < MAX_LINE
    reply = worker.ask(line)
    assert (type(reply), reply.kind) == (p.Error, p.ErrorKind.BAD_REQUEST)
    assert worker.ask(p.Ping(seq=10)).seq == 10


def test_missing_field_is_bad_request_with_seq(worker):
    reply = worker.ask(b'{"op":"forward_step","seq":11}\n')
    assert (type(reply), reply.kind, reply.seq) == (p.Error, p.ErrorKind.BAD_REQUEST, 11)


def test_oversized_line_then_ping(worker):
    worker.send_raw(b'{"op":"ping","seq":12,"pad":"' + b"x" * (3 * MAX_LINE) + b'"}\n')
    reply = worker.lines.get(timeout=REPLY_S)
    reply = codec.decode_reply(reply)
    assert (type(reply), reply.kind) == (p.Error, p.ErrorKind.LINE_TOO_LONG)
    assert worker.ask(p.Ping(seq=13)) == p.Pong(seq=13, rank=1, world_size=2, device="cpu")


def test_step_before_init_is_an_error_not_a_crash(worker):
    step = p.ForwardStep(seq=14, model_id="m", seqs=[p.SeqStep(slot=0, token_ids=[1, 2], offset=0)])
    reply = worker.ask(step)
    assert (type(reply), reply.kind, reply.seq) == (p.Error, p.ErrorKind.MODEL_NOT_LOADED, 14)
    reply = worker.ask(p.ClearKvCache(seq=15, model_id="m"))
    assert (type(reply), reply.kind, reply.seq) == (p.Error, p.ErrorKind.MODEL_NOT_LOADED, 15)
    reply = worker.ask(p.CommSanityCheck(seq=16))
    assert (type(reply), reply.kind, reply.seq) == (p.Error, p.ErrorKind.NOT_INITIALISED, 16)
    assert worker.proc.poll() is None


def test_unknown_backend_is_comm_init_failed(worker):
    reply = worker.ask(p.Init(seq=17, backend="carrier-pigeon", comm_id="x", timeout_s=1.0))
    assert (type(reply), reply.kind, reply.seq) == (p.Error, p.ErrorKind.COMM_INIT_FAILED, 17)


def test_stdin_eof_exits_zero_and_streams_are_clean(worker):
    """Runs last in this module: it ends the shared worker."""
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=15) == 0
    worker.finish_output()
    assert worker.stdout, "the worker answered nothing"
    for line in worker.stdout:
        assert line.endswith(b"\n") and codec.decode_reply(line) is not None, f"non-protocol stdout: {line[:200]!r}"
    logged = [line for line in worker.stderr if line.strip()]
    assert logged, "the worker logged nothing"
    assert all(line.startswith("[rank 1] ") for line in logged), "".join(logged)


def test_shutdown_says_bye_and_exits_zero():
    w = WorkerProcess()
    try:
        assert w.ask(p.Ping(seq=1), timeout=STARTUP_S).seq == 1
        assert w.ask(p.Shutdown(seq=2)) == p.Bye(seq=2)
        assert w.proc.wait(timeout=15) == 0
        w.finish_output()
        assert [codec.decode_reply(line) for line in w.stdout] == [
            p.Pong(seq=1, rank=1, world_size=2, device="cpu"), p.Bye(seq=2)]
    finally:
        w.kill()
