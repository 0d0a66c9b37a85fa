"""The wire protocol: every message round-trips, bad lines become typed errors, lines are bounded."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from neuron.rpc import codec
from neuron.rpc import protocol as p
from neuron.step import StepImage, VerifyShape

REQUESTS = [
    p.Ping(seq=11),
    p.Init(seq=12, backend="nccl", comm_id="ab" * 64, timeout_s=7.5),
    p.CommSanityCheck(seq=13),
    p.CheckKernels(seq=20, config_json='{"hidden_size": 64}', dtype="bfloat16"),
    p.LoadShard(seq=14, model_id="qwen3-tiny",
                shard=p.ShardSpec(config_json='{"hidden_size": 64}', weight_paths=["/m/a.safetensors", "/m/b.safetensors"],
                                  dtype="bfloat16", max_slots=3, max_model_len=512, block_size=32,
                                  kv_cache_bytes=3 << 30, gpu_memory_utilization=0.45, max_num_batched_tokens=2048,
                                  quantization="int8", stored_format={"method": "fp8", "block": [128, 128]},
                                  verify=VerifyShape(tokens=4, batch=8), max_loras=4, max_lora_rank=16),
                failed_kernels={"silu_mul": "rank 1: differs from the reference"}),
    p.ForwardStep(seq=15, model_id="qwen3-tiny",
                   seqs=[p.SeqStep(slot=0, token_ids=[1, 2, 3], offset=32, new_blocks=[7, 4, 9], fresh=True),
                         p.SeqStep(slot=2, token_ids=[9], offset=48, new_blocks=[12]),
                         p.SeqStep(slot=1, token_ids=[5], offset=41),
                         p.SeqStep(slot=3, token_ids=[8, 151655, 151655], offset=0, new_blocks=[2], fresh=True,
                                   images=[StepImage("data:image/png;base64,AAAA", 1)]),
                         p.SeqStep(slot=4, token_ids=[6], offset=9, lora=2)]),
    p.LoadLora(seq=31, model_id="qwen3-tiny", slot=1, lora_id=7, path="/adapters/sql"),
    p.ForgetLora(seq=32, model_id="qwen3-tiny", lora_id=7),
    p.ClearKvCache(seq=17, model_id="qwen3-tiny", slots=[0, 3]),
    p.UnloadModel(seq=18, model_id="qwen3-tiny"),
    p.Shutdown(seq=19),
]

REPLIES = [
    p.Pong(seq=21, rank=2, world_size=4, device="cuda:2", protocol=p.PROTOCOL_VERSION + 1),
    p.InitOk(seq=22, backend="gloo"),
    p.SanityResult(seq=23, observed_sum=4.0),
    p.KernelsChecked(seq=30, failed={"norm_rope": "OutOfResources: shared memory"}),
    p.LoadShardOk(seq=24, model_id="qwen3-tiny", weight_bytes=123_456, num_kv_blocks=4096),
    p.ForwardStepOk(seq=25, elapsed_ms=3.25),
    p.KvCacheCleared(seq=26),
    p.LoraLoaded(seq=33),
    p.Unloaded(seq=27, model_id="qwen3-tiny"),
    p.Bye(seq=28),
    p.Error(seq=29, kind=p.ErrorKind.FORWARD_FAILED, message="CUDA out of memory"),
]

OPS = {
    p.Ping: "ping", p.Init: "init", p.CommSanityCheck: "comm_sanity_check", p.CheckKernels: "check_kernels",
    p.LoadShard: "load_shard", p.KernelsChecked: "kernels_checked",
    p.ForwardStep: "forward_step",
    p.LoadLora: "load_lora", p.ForgetLora: "forget_lora", p.LoraLoaded: "lora_loaded",
    p.ClearKvCache: "clear_kv_cache", p.UnloadModel: "unload_model", p.Shutdown: "shutdown",
    p.Pong: "pong", p.InitOk: "init_ok", p.SanityResult: "sanity_result", p.LoadShardOk: "load_shard_ok",
    p.ForwardStepOk: "forward_step_ok", p.KvCacheCleared: "kv_cache_cleared", p.Unloaded: "unloaded",
    p.Bye: "bye", p.Error: "error",
}


def test_every_message_is_covered():
    assert {type(m) for m in REQUESTS} == set(p.Request.__args__)
    assert {type(m) for m in REPLIES} == set(p.Reply.__args__)
    assert set(OPS) == set(p.Request.__args__) | set(p.Reply.__args__)


@pytest.mark.parametrize("msg,decode", [(m, codec.decode_request) for m in REQUESTS]
                         + [(m, codec.decode_reply) for m in REPLIES], ids=lambda x: type(x).__name__)
def test_round_trip(msg, decode):
    line = codec.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == msg
    assert json.loads(line)["op"] == OPS[type(msg)]


def test_op_sets():
    assert p.REQUEST_OPS == {OPS[t] for t in p.Request.__args__}
    assert p.REPLY_OPS == {OPS[t] for t in p.Reply.__args__}


def test_defaults_are_omitted_and_restored():
    line = codec.encode(p.ClearKvCache(seq=3, model_id="m"))
    assert json.loads(line) == {"op": "clear_kv_cache", "seq": 3, "model_id": "m"}
    assert codec.decode_request(line) == p.ClearKvCache(seq=3, model_id="m", slots=None)


def test_step_seq_stays_small_and_compatible():
    """A decode step's sequence is a short array; a sender that knows no blocks is still understood,
    and the prompt-logprobs flag, the count of positions whose logits come back, the images of a
    sequence's first step and an embedding's pooling ride at the end (msgspec writes every field of
    an array: no images is `[]`, no pooling `null`), then the sequence's LoRA slot (-1: none), and
    last where an encoder pair's second token type starts (`null`: none)."""
    assert codec.encode(p.SeqStep(slot=2, token_ids=[9], offset=41)) == b"[2,[9],41,[],false,null,1,[],null,-1,null]\n"
    flagged = p.SeqStep(slot=2, token_ids=[9, 8], offset=0, prompt_logprobs=1)
    assert codec.encode(flagged) == b"[2,[9,8],0,[],false,1,1,[],null,-1,null]\n"
    speculative = p.SeqStep(slot=2, token_ids=[9, 4, 4, 4], offset=7, logits=4)
    assert codec.encode(speculative) == b"[2,[9,4,4,4],7,[],false,null,4,[],null,-1,null]\n"
    pooled = p.SeqStep(slot=1, token_ids=[5, 6], offset=0, fresh=True, pool="last")
    assert codec.encode(pooled) == b'[1,[5,6],0,[],true,null,1,[],"last",-1,null]\n'
    imaged = p.SeqStep(slot=0, token_ids=[3, 7, 7], offset=0, new_blocks=[1], fresh=True,
                       images=[StepImage("data:image/png;base64,AA==", 1)])
    assert codec.encode(imaged) == b'[0,[3,7,7],0,[1],true,null,1,[["data:image/png;base64,AA==",1]],null,-1,null]\n'
    adapted = p.SeqStep(slot=3, token_ids=[4], offset=2, lora=1)
    assert codec.encode(adapted) == b"[3,[4],2,[],false,null,1,[],null,1,null]\n"
    pair = p.SeqStep(slot=1, token_ids=[2, 5, 3, 6, 3], offset=0, fresh=True, pool="first", types_from=3)
    assert codec.encode(pair) == b'[1,[2,5,3,6,3],0,[],true,null,1,[],"first",-1,3]\n'
    line = b'{"op":"forward_step","seq":5,"model_id":"m","seqs":[[2,[9],41]]}\n'
    step = codec.decode_request(line)
    assert step.seqs == [p.SeqStep(slot=2, token_ids=[9], offset=41, new_blocks=[], fresh=False)]


def test_hand_written_ping():
    assert codec.decode_request(b'{"op":"ping","seq":1}\n') == p.Ping(seq=1)


@pytest.mark.parametrize("line", [b"not json\n", b"\xff\xfe\n", b"[1, 2]\n", b'"ping"\n', b"{\n", b"[" * 100_000,
                                  b'{"op":"ping","seq":1,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_undecodable_request_is_bad_request(line):
    err = codec.decode_request(line)
    assert isinstance(err, p.Error) and err.kind == p.ErrorKind.BAD_REQUEST


def test_unknown_op_keeps_seq():
    err = codec.decode_request(b'{"op":"teleport","seq":42}\n')
    assert err == p.Error(seq=42, kind=p.ErrorKind.UNKNOWN_OP, message=err.message)
    assert "teleport" in err.message


def test_reply_op_sent_as_request_is_unknown():
    err = codec.decode_request(codec.encode(p.Pong(seq=5, rank=1, world_size=2, device="cpu")))
    assert (err.kind, err.seq) == (p.ErrorKind.UNKNOWN_OP, 5)


def test_missing_field_is_bad_request_with_seq():
    err = codec.decode_request(b'{"op":"init","seq":7,"backend":"gloo"}\n')
    assert (type(err), err.kind, err.seq) == (p.Error, p.ErrorKind.BAD_REQUEST, 7)
    assert "comm_id" in err.message


def test_wrong_type_is_bad_request_with_seq():
    err = codec.decode_request(b'{"op":"forward_step","seq":8,"model_id":"m","seqs":"oops"}\n')
    assert (err.kind, err.seq) == (p.ErrorKind.BAD_REQUEST, 8)


def test_error_replies_encode():
    for line in [b"garbage", b'{"op":"nope","seq":3}', b'{"op":"init","seq":true}']:
        err = codec.decode_request(line)
        assert codec.decode_reply(codec.encode(err)) == err


@pytest.mark.parametrize("line", [b"garbage\n", b'{"op":"ping","seq":1}\n', b'{"op":"pong","seq":1}\n', b"{}",
                                  b'{"op":"pong","x":' + b"[" * 100_000])
def test_non_reply_lines_decode_to_none(line):
    assert codec.decode_reply(line) is None


# ---- bounded line reading ----


class CountingStream:
    """A binary stream that records every read size it is asked for."""

    def __init__(self, data: bytes):
        self.inner = io.BytesIO(data)
        self.sizes: list[int] = []
        self.returned: list[int] = []

    def readline(self, size: int = -1) -> bytes:
        self.sizes.append(size)
        chunk = self.inner.readline(size)
        self.returned.append(len(chunk))
        return chunk


def test_read_line_plain_and_eof():
    stream = io.BytesIO(b"one\ntwo\nlast")
    assert [codec.read_line(stream, 16) for _ in range(4)] == [b"one\n", b"two\n", b"last", None]


def test_read_line_limit_is_inclusive():
    limit = 8
    stream = io.BytesIO(b"x" * limit + b"\n" + b"y" * limit)
    assert codec.read_line(stream, limit) == b"x" * limit + b"\n"
    assert codec.read_line(stream, limit) == b"y" * limit


def test_oversized_line_is_skipped_without_buffering():
    limit = 64
    ping = codec.encode(p.Ping(seq=9))
    stream = CountingStream(b"z" * (50 * limit) + b"\n" + ping)
    with pytest.raises(codec.LineTooLong):
        codec.read_line(stream, limit)
    assert codec.decode_request(codec.read_line(stream, limit)) == p.Ping(seq=9)
    assert codec.read_line(stream, limit) is None
    assert all(0 < size <= limit + 1 for size in stream.sizes)
    assert max(stream.returned) <= limit + 1


def test_oversized_line_at_eof():
    stream = io.BytesIO(b"z" * 100)
    with pytest.raises(codec.LineTooLong):
        codec.read_line(stream, 10)
    assert codec.read_line(stream, 10) is None


def test_max_line_bytes_from_env(monkeypatch):
    monkeypatch.delenv("NEURON_MAX_LINE_BYTES", raising=False)
    assert codec.max_line_bytes() == 64 * 2**20
    monkeypatch.setenv("NEURON_MAX_LINE_BYTES", "4096")
    assert codec.max_line_bytes() == 4096
    monkeypatch.setenv("NEURON_MAX_LINE_BYTES", "1MiB")
    assert codec.max_line_bytes() == 2**20


# ---- properties ----

_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)
_ops = st.sampled_from(sorted(p.REQUEST_OPS | p.REPLY_OPS)) | st.text(max_size=12)
_objects = st.dictionaries(st.sampled_from(["seq", "model_id", "seqs", "backend", "comm_id", "rank", "kind"]),
                           _json, max_size=4).flatmap(lambda d: _ops.map(lambda op: {**d, "op": op}))


def _check_request(line: bytes) -> None:
    out = codec.decode_request(line)
    if isinstance(out, p.Error):
        assert out.kind in (p.ErrorKind.BAD_REQUEST, p.ErrorKind.UNKNOWN_OP)
    else:
        assert isinstance(out, p.Request.__args__)
    codec.encode(out)  # whatever came out can be sent back


def _check_reply(line: bytes) -> None:
    out = codec.decode_reply(line)
    assert out is None or isinstance(out, p.Reply.__args__)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
@example(b'"\x80"')  # a JSON string holding a byte that is not UTF-8
@example(b'{"op": "ping", "seq": 1, "x": "\xff"}')
def test_arbitrary_bytes_never_raise(data):
    _check_request(data)
    _check_reply(data)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(_objects)
def test_arbitrary_json_objects_never_raise(obj):
    line = json.dumps(obj).encode()
    _check_request(line)
    _check_reply(line)


def test_rpc_does_not_import_torch():
    code = "import sys, neuron.rpc, neuron.rpc.codec, neuron.rpc.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
