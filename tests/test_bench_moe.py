"""scripts/bench_moe.py's drawn checkpoints (the path `--shape 30b-a3b` takes on a GPU) on CPU: the
tensors transformers expects, both sides decoding them alike, and a whole `--shape tiny` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_moe.py"


@pytest.fixture
def bench_moe(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_moe

    return bench_moe


def tiny_config(bench_moe) -> dict:
    return bench_moe.drawn_config(bench_moe.SHAPES["tiny"], "float32")


def test_drawn_tensors_are_the_ones_transformers_loads_and_saves(bench_moe, tmp_path):
    """Fused: transformers 5's parameters; per expert: what its save_pretrained writes (and Qwen publishes)."""
    from safetensors import safe_open
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    cfg = tiny_config(bench_moe)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(tmp_path))
    assert (model.config.num_experts, model.config.rope_parameters["rope_theta"]) == (8, 1e6)  # as published
    in_memory = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert dict(bench_moe.moe_tensor_shapes(cfg, "fused")) == in_memory
    model.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert dict(bench_moe.moe_tensor_shapes(cfg, "per-expert")) == saved


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_transformers_and_neuron_decode_a_drawn_checkpoint_alike(bench_moe, tmp_path, monkeypatch, layout):
    """Tokens and their logprobs: at weights * 0.02 and hidden 64 the experts move a logprob by about
    3e-3 when gate and up are swapped, the two sides differ by about 5e-7."""
    from gpu_bench.children import hf_load

    from neuron import LLM, SamplingParams

    monkeypatch.setattr(bench_moe, "SHARD_BYTES", 1 << 18)  # about 1 MB of weights: several files and an index
    path = tmp_path / "moe"
    info = bench_moe.draw_checkpoint(path, tiny_config(bench_moe), layout, "cpu")
    assert info["files"] == len(list(path.glob("*.safetensors"))) > 1
    assert (path / "model.safetensors.index.json").is_file()
    prompt = bench_moe.prompts(1, 16, 1024)[0]
    model = hf_load(str(path), "cpu", "float32")
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    expected = out.sequences[0, 16:].tolist()
    expected_lp = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, expected)]
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=32, max_num_seqs=1) as llm:
        got = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=8, logprobs=0))[0].outputs[0]
    assert got.token_ids == expected
    assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(expected_lp, abs=1e-4)


def _run(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--device", "cpu", "--json-out", str(out),
                           *argv], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_tiny_run_measures_both_sides_at_both_batch_sizes(tmp_path):
    proc, doc = _run(tmp_path, "--attention", "paged", "--layout", "fused")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error" not in doc
    assert [(r["tp"], r["batch"]) for r in doc["runs"]] == [(1, 1), (1, 16)]
    assert all(r["neuron_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in doc["runs"])
    assert (doc["shape_name"], doc["layers"], doc["attention"], doc["layout"]) == ("tiny", 2, "paged", "fused")
    assert (doc["device"], doc["dtype"], doc["env"]["gpu"]) == ("cpu", "float32", "none")
    assert doc["checkpoint"]["params"] == doc["runs"][0]["params"] > 0
    assert "NEURON_ATTENTION=paged" in proc.stdout
    assert "neuron tp=1 batch 16:" in proc.stdout
    assert list(tmp_path.glob("bench_moe-*")) == []  # the checkpoint's directory is gone


def test_a_run_past_its_deadline_stops_and_says_so(tmp_path):
    proc, doc = _run(tmp_path, "--deadline", "0.3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert doc["error"] == "stopped at the --deadline of 0.3 s"
    assert doc["runs"] == []
    assert "stopped at the --deadline of 0.3 s" in proc.stderr
    assert list(tmp_path.glob("bench_moe-*")) == []
