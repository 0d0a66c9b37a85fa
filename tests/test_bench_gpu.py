"""scripts/bench_gpu.py in --tiny mode on CPU, and `neuron bench` against a checkpoint without a
tokenizer (what the benchmark's serve part drives)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from checkpoints import build_checkpoint
from server_harness import LiveServer, real_engine

from neuron.bench import BenchConfig, result_summary, run_benchmark

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"bandwidth", "checkpoint", "decode", "offline", "tp2", "serve"}


@pytest.fixture(scope="module")
def tokenizerless_server(tmp_path_factory):
    """A live server on a random checkpoint with no tokenizer.json: it streams no text. A vocabulary
    of 1024 covers the token ids `neuron bench` draws."""
    path = build_checkpoint(tmp_path_factory.mktemp("no-tokenizer"), vocab_size=1024)
    assert not (path / "tokenizer.json").exists()
    with LiveServer(real_engine(str(path), 1, max_model_len=128)) as server:
        yield server.wait_ready()


def _bench(server: LiveServer, **kw):
    cfg = BenchConfig(server.base_url, num_requests=3, concurrency=2, input_len=(8, 8), output_len=(5, 5),
                      ignore_eos=True, **kw)
    return anyio.run(run_benchmark, cfg)


def test_bench_times_every_token_of_a_tokenizerless_server_with_logprobs(tokenizerless_server):
    result = _bench(tokenizerless_server, logprobs=0)
    assert [r.ok for r in result.records] == [True] * 3
    assert [r.output_tokens for r in result.records] == [5] * 3
    assert [r.prompt_tokens for r in result.records] == [8] * 3
    # One chunk per token: four gaps between five tokens, so TTFT and TPOT are per token.
    assert [len(r.itl_s) for r in result.records] == [4] * 3
    assert all(r.ttft_s > 0 and r.tpot_s > 0 for r in result.records)
    assert result_summary(result).output_tokens == 15


def test_bench_names_the_fix_when_a_server_streams_no_text(tokenizerless_server):
    result = _bench(tokenizerless_server)
    expected = ("the server generated 5 tokens but streamed no text (a checkpoint without a tokenizer?); "
                "pass --logprobs 0 so that each token arrives in its own chunk")
    assert [r.error for r in result.records] == [expected] * 3


def test_a_child_past_its_deadline_is_reported_and_the_run_still_reports(tmp_path):
    out, md = tmp_path / "tmp.json", tmp_path / "tmp.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--tiny", "--device", "cpu", "--only", "decode",
           "--deadline", "0.2", "--out", str(out), "--md", str(md)]
    # TMPDIR: the logs a failed run keeps land in this test's directory.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"logs kept in {tmp_path}" in proc.stderr
    errors = {(r["part"], r["engine"]): r["error"] for r in json.loads(out.read_text())["rows"]}
    late, unbuilt = "failed: timed out after 0.2 s", "failed: no tiny checkpoint (timed out after 0.2 s)"
    assert errors == {("bandwidth", "device"): late, ("checkpoint", "-"): late,
                      ("bandwidth", "bandwidth limit"): "failed: no bandwidth figure",
                      ("decode", "transformers eager"): unbuilt, ("decode", "transformers static"): unbuilt,
                      ("decode", "neuron gather"): unbuilt, ("decode", "neuron paged"): unbuilt}
    assert f"| {unbuilt} |" in md.read_text()


@pytest.mark.slow
def test_tiny_run_measures_every_part(tmp_path):
    out, md = tmp_path / "tmp.json", tmp_path / "tmp.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--tiny", "--device", "cpu", "--out", str(out),
           "--md", str(md), "--deadline", "90"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {r["part"] for r in rows} == PARTS
    failed = [(r["part"], r["engine"], r["error"]) for r in rows if r["error"]]
    assert failed == []
    measured = [r for r in rows if r["engine"].startswith("neuron") or r["engine"] == "transformers eager"]
    # per attention path: decode, offline (a), offline (b), tp2; then serve x2, serve/offline; eager x2
    assert len(measured) == 4 * 2 + 3 + 2
    engines = {r["engine"] for r in rows if r["part"] == "decode"}
    assert {"neuron gather", "neuron paged"} <= engines
    serve_note = next(r["note"] for r in rows if r["engine"] == "neuron serve")
    best = max(("gather", "paged"), key=lambda m: next(r["value"] for r in rows if r["engine"] == f"neuron {m}"
                                                       and r["figure"] == "offline (a)"))
    assert serve_note.startswith(f"attention {best};")  # the server ran the faster offline path
    assert all(r["value"] > 0 for r in measured)
    static = next(r for r in rows if r["engine"] == "transformers static")
    assert "NOT compiled" in static["note"]  # said, not silent, where transformers cannot compile
    assert doc["env"]["device"] == "cpu"
    text = md.read_text()
    assert "| part | shape | engine | figure | value | unit | vs transformers | vs limit | note |" in text
    assert text.count("\n| ") == len(rows) + 1 + len(doc["env"]) + 1  # header rows of both tables
    assert proc.stdout.strip() == text.strip()
