"""The prefix cache's timing side channel, measured as a client would: can one client tell from its
time to first token whether another client sent a given prompt prefix?

    python scripts/probe_prefix_timing.py --isolation none      # the channel open
    python scripts/probe_prefix_timing.py --isolation api-key   # clients with different keys
    python scripts/probe_prefix_timing.py --isolation salt

Starts `neuron serve` (the embedded model, CPU) with the isolation given. The prober (key B) first
calibrates on prefixes of its own: fresh ones (misses) and ones it sent before under a cache_salt
of its own (hits, in every mode); its threshold lies between the two medians. Then each trial
draws a new prefix, a coin decides whether the victim (key A) sends it, and the prober sends it
with one token of its own (no cache_salt) and guesses "sent" when its first token comes sooner than
the threshold. Prints the median time to first token with and without the victim's request and
how often the guess was right (50%: a coin).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx


def start(isolation: str, max_model_len: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "neuron", "serve", "--port", "0", "--device", "cpu", "--log-level", "info",
           "--max-model-len", str(max_model_len), "--prefix-cache-isolation", isolation]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 300
    while not any("ready: serving" in line for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not start:\n" + "".join(lines[-20:]))
        time.sleep(0.1)
    ready = next(line for line in lines if "ready: serving" in line)
    return proc, re.search(r"(http://127\.0\.0\.1:\d+/v1)", ready).group(1)


def ttft(http: httpx.Client, url: str, key: str, prompt: list[int], salt: str | None = None) -> float:
    """Seconds from sending a streamed completion to its first token's chunk."""
    body = {"model": "neuron-default", "prompt": prompt, "max_tokens": 1, "stream": True, "logprobs": 0,
            "ignore_eos": True, **({"cache_salt": salt} if salt else {})}
    t0 = time.perf_counter()
    with http.stream("POST", f"{url}/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def calibrate(http: httpx.Client, url: str, rng: random.Random, n: int, length: int) -> float:
    """The prober's threshold: between its median time for a prefix it sent before (under a salt of
    its own, so cached in every mode) and for a fresh one, at their geometric mean (times on a busy
    machine spread by a factor, not by a number of milliseconds)."""
    hits, misses = [], []
    for _ in range(n):
        prefix = _tokens(rng, length)
        misses.append(ttft(http, url, "key-B", prefix + _tokens(rng, 1), "prober-own-salt"))
        hits.append(ttft(http, url, "key-B", prefix + _tokens(rng, 1), "prober-own-salt"))
    return statistics.geometric_mean([statistics.median(hits), statistics.median(misses)])


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1300) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isolation", default="none", choices=("none", "api-key", "salt"))
    ap.add_argument("--prefix", type=int, default=2013, help="prefix tokens")
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    proc, url = start(args.isolation, max(2048, args.prefix + 64))
    times: dict[bool, list[float]] = {True: [], False: []}
    right = 0
    try:
        with httpx.Client(timeout=60) as http:
            ttft(http, url, "warm-up", [1, 2, 3])
            threshold = calibrate(http, url, rng, 10, args.prefix)
            for _ in range(args.trials):
                prefix = _tokens(rng, args.prefix)
                sent = rng.random() < 0.5
                if sent:
                    ttft(http, url, "key-A", prefix + _tokens(rng, 1))
                t = ttft(http, url, "key-B", prefix + _tokens(rng, 1))
                times[sent].append(t)
                right += (t < threshold) == sent
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"--prefix-cache-isolation {args.isolation}, {args.prefix}-token prefix, {args.trials} trials, "
          f"threshold {threshold * 1e3:.0f} ms")
    for sent, label in ((True, "the victim sent it"), (False, "it did not")):
        print(f"  {label}: median TTFT {statistics.median(times[sent]) * 1e3:.0f} ms ({len(times[sent])} trials)")
    print(f"  the prober guessed right {right} times out of {args.trials}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
