"""scripts/bench_peers.py's table: each engine's best run, ratios against vLLM, and the block it
replaces in docs/benchmarks.md (the runs themselves need the peer's venv and take minutes)."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
bench = runpy.run_path(str(ROOT / "scripts" / "bench_peers.py"))


def _run(label, b1, out, total, load):
    return {"label": label, "b1": {"tok_s": b1}, "tput": {"output_tok_s": out, "total_tok_s": total},
            "load_before": load}


RUNS = [_run("vLLM CPU", 13.0, 100.0, 240.0, 1.5), _run("neuron (default)", 20.0, 150.0, 350.0, 1.6),
        _run("vLLM CPU", 14.0, 107.0, 242.0, 2.0), _run("neuron (default)", 22.0, 140.0, 330.0, 2.1)]


def test_table_takes_each_engines_best_run_and_its_ratio():
    table = bench["render"](RUNS, {})
    lines = table.splitlines()
    assert lines[0] == "| workload | vLLM CPU | neuron (default) | neuron (default) / vLLM |"
    assert lines[2] == "| batch-1 decode, 16-token prompt, 128 out (tok/s) | 14.0 | 22.0 | **1.57x** |"
    assert lines[3].endswith("| 107.0 | 150.0 | **1.40x** |")
    assert "best of 2 alternated runs" in table and "vLLM CPU 2.00" in table


def test_write_replaces_only_its_block(tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nearlier text\n")
    monkeypatch.setitem(bench["write_doc"].__globals__, "DOC", doc)
    bench["write_doc"]("first table")
    bench["write_doc"]("second table")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nearlier text\n") and text.count("bench_peers: begin") == 1
    assert "second table" in text and "first table" not in text


def test_the_vllm_wrapper_is_put_under_a_main_guard_once(tmp_path):
    """setup.sh's wrapper calls main() at import; vLLM's spawned engine core re-imports it."""
    script = tmp_path / "vllm"
    script.write_text("import sys\nfrom vllm.entrypoints.cli.main import main\nsys.exit(main())\n")
    bench["guard_entry_point"](script)
    guarded = script.read_text()
    assert guarded.endswith('if __name__ == "__main__":\n    sys.exit(main())\n')
    bench["guard_entry_point"](script)
    assert script.read_text() == guarded
