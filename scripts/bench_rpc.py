"""What the wire costs per step: a decode `forward_step` for a batch of B sequences (one in 16
crossing into a new KV block, as in a steady decode with 16-token blocks) sent to a live worker
and its reply read back, without the forward (the worker has no model loaded, so it decodes
the whole request and answers `model_not_loaded`; encoding, pipes and decoding are all paid).

    python scripts/bench_rpc.py --batch 64 --n 2000
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from neuron.rpc import codec
from neuron.rpc import protocol as p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-m", "neuron", "--worker", "--rank", "1", "--tp-size", "2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    seqs = [p.SeqStep(slot=i, token_ids=[100_000 + i], offset=1000 + i, new_blocks=[] if i % 16 else [5000 + i])
            for i in range(args.batch)]
    samples, size = [], 0
    try:
        for seq in range(1, args.n + 1):
            t0 = time.perf_counter()
            line = codec.encode(p.ForwardStep(seq=seq, model_id="model", seqs=seqs))
            proc.stdin.write(line)
            proc.stdin.flush()
            reply = codec.decode_reply(proc.stdout.readline())
            samples.append(time.perf_counter() - t0)
            size = len(line)
            assert isinstance(reply, p.Error) and reply.seq == seq and reply.kind == "model_not_loaded"
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    samples = sorted(samples[50:])
    print(f"forward_step, batch {args.batch}: {size} bytes per request; round trip median "
          f"{statistics.median(samples) * 1e6:.1f} us, p90 {samples[int(len(samples) * 0.9)] * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
