"""The start-up self-check of the fused CUDA kernels, its logic tested on CPU with fakes: a kernel
that raises, one that computes wrong values, one that returns NaN, each degrades exactly its own
piece; the verdict is cached per card; the ranks run the union of every rank's failures; a CUDA
graph bucket that cannot be captured is dropped alone; /health and `neuron doctor` show it all."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import torch
from server_harness import LiveServer, ScriptedEngine, scripted_engine

from neuron.layers import kernel_check, norm
from neuron.layers.kernel_check import Widths
from neuron.layers.kernels import PIECES, Kernels
from neuron.layers.paged_attention import paged_attention_reference
from neuron.worker import cuda_graphs

WIDTHS = Widths(hidden=48, heads=4, kv_heads=2, head_dim=16, intermediate=40)


def references() -> dict:
    """Every piece's PyTorch reference in its kernel's place: what a card whose kernels work gives."""
    return {"rms_norm": norm.rms_norm_reference, "add_rms_norm": norm.add_rms_norm_reference,
            "norm_rope": lambda x, w, eps, cos, sin: norm.apply_rotary(norm.rms_norm_reference(x, w, eps), cos, sin),
            "silu_mul": norm.silu_mul_reference, "paged_attention": paged_attention_reference,
            "quant_linear": lambda x, w: torch.nn.functional.linear(x, w.stored(x.dtype)),
            "lora": lambda pool, y, x, rows: pool.add_grouped(y.clone(), x, rows)}


def test_working_kernels_pass_every_shape():
    assert kernel_check.check("cpu", torch.float32, WIDTHS, references()) == {}


def test_each_broken_kernel_degrades_its_own_piece_alone():
    def raises(*args):
        raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: shared memory\nmore")

    def off_by_a_little(gate, up):
        return norm.silu_mul_reference(gate, up) * 1.01

    def nan_rows(q, k_pool, v_pool, meta, scale):
        out = paged_attention_reference(q, k_pool, v_pool, meta, scale)
        out[-1] = float("nan")
        return out

    fakes = references() | {"rms_norm": raises, "silu_mul": off_by_a_little, "paged_attention": nan_rows}
    failures = kernel_check.check("cpu", torch.float32, WIDTHS, fakes)
    assert set(failures) == {"rms_norm", "silu_mul", "paged_attention"}
    assert failures["rms_norm"] == "rms_norm: RuntimeError: triton.runtime.errors.OutOfResources: out of resource: " \
                                   "shared memory"
    assert failures["silu_mul"].startswith("silu_mul: differs from the reference by 1.0")
    assert failures["paged_attention"] == "paged attention, decode: NaN or inf in the output"


def test_attention_is_checked_on_the_shapes_that_broke_kernels_before():
    seen = []

    def spy(q, k_pool, v_pool, meta, scale):
        seen.append((meta.max_query_len, meta.block_size, meta.kv_lens.tolist()))
        return paged_attention_reference(q, k_pool, v_pool, meta, scale)

    assert kernel_check.check("cpu", torch.float32, WIDTHS, references() | {"paged_attention": spy}) == {}
    assert seen == [(1, 16, [41, 2, 131]), (37, 16, [37]), (20, 16, [52, 5]), (30, 12, [37, 51]), (1, 16, [1])]


def test_a_failed_piece_runs_its_reference_and_the_verdict_says_why(monkeypatch):
    kernels = Kernels.from_settings({"silu_mul": "rank 1: differs from the reference by 1.0e-02 of its largest value"})
    assert [kernels.triton(p) for p in PIECES] == [True, True, True, False, True, True, True]
    assert kernels.verdict()["silu_mul"] == "reference: rank 1: differs from the reference by 1.0e-02 of its largest value"
    assert kernels.verdict()["rms_norm"] == "triton"
    monkeypatch.setenv("NEURON_KERNELS", "reference")
    forced = Kernels.from_settings()
    assert not any(forced.triton(p) for p in PIECES)
    assert set(forced.verdict().values()) == {"reference: NEURON_KERNELS=reference"}
    monkeypatch.setenv("NEURON_KERNELS", "triton")
    assert all(Kernels.from_settings({"silu_mul": "ignored when forced"}).triton(p) for p in PIECES)
    assert [kernels.triton(p) for p in PIECES] == [True, True, True, False, True, True, True]  # built before: unchanged


def test_two_models_in_one_process_run_their_own_kernels(tmp_path):
    """Rank 0 and a speculative draft share the leader's process: each model's layers hold the
    choice it was loaded with, and loading one does not change the other's."""
    from checkpoints import BASE, build_checkpoint, shard_spec

    from neuron.rpc import protocol as p
    from neuron.worker.worker import Worker

    path = build_checkpoint(tmp_path / "qwen3", **BASE)
    rank = Worker(0, 1)

    def load(model_id: str, failed: dict[str, str]):
        shard = shard_spec(path, max_num_seqs=1, max_model_len=64, max_num_batched_tokens=64)
        reply, _ = rank.execute(p.LoadShard(seq=1, model_id=model_id, shard=shard, failed_kernels=failed))
        assert isinstance(reply, p.LoadShardOk), reply
        return rank.models[model_id]

    try:
        target = load("target", {"silu_mul": "rank 1: NaN or inf in the output"})
        draft = load("draft", {})
        assert not target.kernels.triton("silu_mul") and draft.kernels.triton("silu_mul")
        layer = target.model.layers[0]
        assert layer.mlp.gate_up.kernels is target.kernels and layer.post_norm.kernels is target.kernels
        assert target.model.cache.kernels is target.kernels
        assert draft.model.layers[0].mlp.gate_up.kernels is draft.kernels
    finally:
        rank.close()


def test_the_verdict_is_cached_per_card_and_a_dying_check_fails_every_piece(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path))
    calls = []

    def runner(args):
        calls.append(args)
        return json.dumps({"norm_rope": "OutOfResources"})

    assert kernel_check.self_check("cuda:0", "bfloat16", WIDTHS, runner) == {"norm_rope": "OutOfResources"}
    assert kernel_check.self_check("cuda:0", "bfloat16", WIDTHS, runner) == {"norm_rope": "OutOfResources"}
    assert len(calls) == 1 and calls[0][1:3] == ["-m", "neuron.layers.kernel_check"]
    other = Widths(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=40)

    def dies(args):
        raise subprocess.SubprocessError("exit -11: Segmentation fault")

    failed = kernel_check.self_check("cuda:0", "bfloat16", other, dies)
    assert failed == dict.fromkeys(PIECES, "the self-check process failed: exit -11: Segmentation fault")
    assert kernel_check.self_check("cuda:0", "bfloat16", other, runner) == {"norm_rope": "OutOfResources"}  # not kept


def test_the_check_runs_as_a_command_and_prints_one_json_line():
    code = ("import json, sys; from neuron.layers import kernel_check as k; import test_kernel_check as t; "
            "print(json.dumps(k.check('cpu', __import__('torch').float32, t.WIDTHS, t.references())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=__file__.rsplit("/", 1)[0])
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_every_rank_runs_the_union_of_the_failures():
    from neuron.executor.executor import Executor
    from neuron.rpc import protocol as p

    executor = Executor.__new__(Executor)
    executor.shard = type("Shard", (), {"dtype": "bfloat16"})()
    executor.cfg = type("Cfg", (), {"load_timeout_s": 5.0})()
    answers = [{}, {"silu_mul": "NaN or inf in the output"}, {"silu_mul": "other", "rms_norm": "raises"}]
    executor._run = lambda make, deadline_s: ([p.KernelsChecked(seq=1, failed=f) for f in answers], None)
    assert executor._check_kernels("{}") == {"silu_mul": "rank 1: NaN or inf in the output", "rms_norm": "rank 2: raises"}


def test_health_shows_the_kernels_verdict(default_tokenizer):
    stub = ScriptedEngine(default_tokenizer, {})
    verdict = {"rms_norm": "triton", "silu_mul": "reference: rank 0: NaN or inf in the output"}
    stub.executor.kernels = lambda: verdict
    with LiveServer(scripted_engine(stub)) as s:
        s.wait_ready(10)
        assert httpx.get(f"{s.url}/health").json() == {"status": "ready", "kernels": verdict}


def test_a_bucket_that_cannot_be_captured_is_dropped_alone(monkeypatch):
    graphs = cuda_graphs.DecodeGraphs.__new__(cuda_graphs.DecodeGraphs)
    graphs.buckets, graphs.graphs, graphs.outputs = [1, 2, 4, 8], {}, {}
    monkeypatch.setattr(graphs, "_pad", lambda start, end: None, raising=False)
    monkeypatch.setattr(graphs, "_synchronize", lambda: None, raising=False)

    def warm_up(bucket):
        if bucket == 8:  # the eager step under sync-debug "error": an op that waits for the host
            raise RuntimeError("called a synchronizing CUDA operation\n  File moe.py, line 187, in _loop")

    def capture_bucket(bucket, pool):
        if bucket == 4:  # an op capture refuses
            raise RuntimeError("operation not permitted when stream is capturing\nCUDA error")
        graphs.graphs[bucket] = f"graph {bucket}"
        return "pool"

    def check_replay(bucket):
        if bucket == 2:
            raise ValueError("its replay differs from the eager step by 0.5")

    monkeypatch.setattr(graphs, "_warm_up", warm_up, raising=False)
    monkeypatch.setattr(graphs, "_capture_bucket", capture_bucket, raising=False)
    monkeypatch.setattr(graphs, "_check_replay", check_replay, raising=False)
    failed = graphs.capture()
    assert failed == {8: "RuntimeError: called a synchronizing CUDA operation",
                      4: "RuntimeError: operation not permitted when stream is capturing",
                      2: "ValueError: its replay differs from the eager step by 0.5"}
    assert sorted(graphs.graphs) == [1]
    assert graphs.bucket(3) == 4 and 4 not in graphs.graphs  # its steps run eagerly: run() finds no graph


def test_doctor_runs_on_a_cpu_machine_and_says_what_it_would_check():
    out = subprocess.run([sys.executable, "-m", "neuron", "doctor", "--json"], capture_output=True, text=True,
                         check=True, timeout=120)
    report = json.loads(out.stdout)
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["gpus"] == [] and env["python"] == sys.version.split()[0]
    assert report["kernels"]["cpu_attention"] == report["kernels"]["cpu_ops"] == "built"
    assert report["kernels"]["gpu"].startswith("no CUDA device: on a GPU this checks rms_norm, add_rms_norm")


def test_doctor_reports_each_gpus_failing_kernels(monkeypatch):
    from neuron.entrypoints import doctor
    from neuron.layers import kernel_check as check

    answers = iter(['{"silu_mul": "silu_mul: differs from the reference by 1.0e-02 of its largest value"}', "{}"])
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(check, "run_check_process", lambda args: (calls.append(args), next(answers))[1])
    report = doctor.checks("bfloat16", json.dumps({"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
                                                   "intermediate": 96}))
    assert report["cuda:0"] == {"silu_mul": "silu_mul: differs from the reference by 1.0e-02 of its largest value"}
    assert report["cuda:1"] == "every kernel matches its reference"
    assert [a[a.index("--device") + 1] for a in calls] == ["cuda:0", "cuda:1"]
