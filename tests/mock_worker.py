"""A scriptable stand-in for `neuron --worker` that speaks the wire protocol without torch.

    python tests/mock_worker.py --rank N --tp-size W [--script JSON]

The script (or env NEURON_MOCK_SCRIPT) is a JSON list of rules; the first rule that matches an
incoming request decides what happens to it. A rule matches on:

    op      the request's op (required)
    nth     only its nth occurrence, counting from 1 (default: every occurrence)
    rank    only on this rank (default: every rank; useful when the script comes from the env)

and carries an `action` (default `reply`) with its parameters:

    reply       the normal reply
    delay       sleep `s` seconds, then the normal reply
    error       an `error` reply with `kind` and `message`
    crash       sleep `s` seconds (default 0), then exit with `code` (default 3) without replying
    hang        never reply and never read again (ignores shutdown and EOF)
    silence     never reply to this request, but keep serving later ones
    stale       first a reply with seq `stale_seq` (default seq - 1000), then the normal reply
    duplicate   the normal reply twice (the second is stale for the next request)
    garbage     a non-JSON line, then the normal reply
    oversized   an error line with this seq longer than NEURON_MAX_LINE_BYTES, then the normal reply
    version     (ping only) a pong that claims protocol version `protocol`
    orphan      exit with `code` (default 3) without replying, leaving a child that holds stdout open
                for `s` seconds (default 5), so the leader sees no EOF

Unmatched requests get the normal reply. The process exits 0 on `shutdown` or stdin EOF.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

from neuron.rpc import codec
from neuron.rpc import protocol as p


class Mock:
    def __init__(self, rank: int, world_size: int, rules: list[dict]):
        self.rank = rank
        self.world_size = world_size
        self.rules = [r for r in rules if r.get("rank", rank) == rank]
        self.seen: Counter[str] = Counter()
        self.out = sys.stdout.buffer

    def log(self, text: str) -> None:
        print(f"[rank {self.rank}] mock: {text}", file=sys.stderr, flush=True)

    def send_raw(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()

    def send(self, msg: p.Message) -> None:
        self.send_raw(codec.encode(msg))

    def normal_reply(self, req: p.Request) -> p.Reply:
        seq = req.seq
        match req:
            case p.Ping():
                return p.Pong(seq=seq, rank=self.rank, world_size=self.world_size, device="mock")
            case p.Init():
                return p.InitOk(seq=seq, backend=req.backend)
            case p.CommSanityCheck():
                return p.SanityResult(seq=seq, observed_sum=float(self.world_size))
            case p.CheckKernels():
                return p.KernelsChecked(seq=seq)
            case p.LoadShard():
                shard = req.shard
                blocks = shard.max_slots * -(-shard.max_model_len // shard.block_size)  # a CPU rank's default pool
                return p.LoadShardOk(seq=seq, model_id=req.model_id, num_kv_blocks=blocks)
            case p.ForwardStep():
                return p.ForwardStepOk(seq=seq, elapsed_ms=float(self.rank))
            case p.ClearKvCache():
                return p.KvCacheCleared(seq=seq)
            case p.UnloadModel():
                return p.Unloaded(seq=seq, model_id=req.model_id)
            case p.Shutdown():
                return p.Bye(seq=seq)
        return p.Error(seq=seq, kind=p.ErrorKind.UNKNOWN_OP, message=type(req).__name__)

    def rule_for(self, op: str) -> dict:
        self.seen[op] += 1
        for rule in self.rules:
            if rule["op"] == op and rule.get("nth", self.seen[op]) == self.seen[op]:
                return rule
        return {"action": "reply"}

    def handle(self, req: p.Request) -> None:
        op = req.__struct_config__.tag
        rule = self.rule_for(op)
        action = rule.get("action", "reply")
        if action != "reply":
            self.log(f"{op} seq {req.seq}: {action}")
        reply = self.normal_reply(req)
        match action:
            case "reply":
                pass
            case "delay":
                time.sleep(float(rule.get("s", 0.5)))
            case "error":
                reply = p.Error(seq=req.seq, kind=rule.get("kind", "forward_failed"),
                                message=rule.get("message", "scripted error"))
            case "crash":
                time.sleep(float(rule.get("s", 0.0)))
                os._exit(int(rule.get("code", 3)))
            case "hang":
                while True:
                    time.sleep(3600)
            case "orphan":
                subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({float(rule.get('s', 5.0))})"],
                                 stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.DEVNULL)
                os._exit(int(rule.get("code", 3)))
            case "silence":
                return
            case "stale":
                stale = p.Error(seq=int(rule.get("stale_seq", req.seq - 1000)), kind="stale", message="old")
                self.send(stale)
            case "duplicate":
                self.send(reply)
            case "garbage":
                self.send_raw(b"this is not json {\n")
            case "version":
                reply = p.Pong(seq=req.seq, rank=self.rank, world_size=self.world_size, device="mock",
                               protocol=int(rule["protocol"]))
            case "oversized":
                filler = "x" * (codec.max_line_bytes() + 16)
                self.send(p.Error(seq=req.seq, kind="oversized", message=filler))
            case _:
                raise SystemExit(f"unknown mock action {action!r}")
        self.send(reply)
        if isinstance(req, p.Shutdown):
            self.log("bye")
            sys.exit(0)

    def serve(self, stdin) -> int:
        limit = codec.max_line_bytes()
        while True:
            try:
                line = codec.read_line(stdin, limit)
            except codec.LineTooLong as exc:
                self.send(p.Error(seq=-1, kind=p.ErrorKind.LINE_TOO_LONG, message=str(exc)))
                continue
            if line is None:
                self.log("stdin closed")
                return 0
            if not line.strip():
                continue
            req = codec.decode_request(line)
            if isinstance(req, p.Error):
                self.send(req)
            else:
                self.handle(req)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp-size", type=int, required=True)
    ap.add_argument("--device", default="mock")
    ap.add_argument("--script", default=os.environ.get("NEURON_MOCK_SCRIPT", "[]"))
    args = ap.parse_args()
    mock = Mock(args.rank, args.tp_size, json.loads(args.script))
    mock.log(f"ready (world_size={args.tp_size}, pid={os.getpid()})")
    return mock.serve(sys.stdin.buffer)


if __name__ == "__main__":
    sys.exit(main())
