"""CPU fp32 linear layers by rows: neuron's kernel on the weight held as panels (what the layers
run), its kernel on the row-major weight, oneDNN on the row-major weight (what runs above
cpu_ops.MAX_LINEAR_ROWS), oneDNN on a packed copy (what ran before one copy of the weights) and
F.linear.

    python scripts/bench_linear.py                       # the 191M model's weights, 1-512 rows
    python scripts/bench_linear.py --rows 8 16 --rounds 9
    python scripts/bench_linear.py --model smollm2       # SmolLM2-135M's
    python scripts/bench_linear.py --model bert-base     # an encoder layer of BERT-base's shape (no head)

The weights are one layer of the 191M benchmark model (hidden 1024, intermediate 3072, 16 / 8
heads of 128) and its LM head (32,000), or of SmolLM2-135M (hidden 576, intermediate 1536, 9 / 3
heads of 64, 49,152 vocabulary), random. Each round times every path once per shape, one
after the other, so that load from other processes falls on all of them alike; the figure is
the best round, in milliseconds for the whole set and GFLOP/s. oneDNN sees steps of fewer than
cpu_linear.PADDED_ROWS rows padded up to it, as the layers send them.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from neuron.layers import cpu_linear, cpu_ops

MODELS = {
    "191m": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
             "lm_head": (32000, 1024)},
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                "lm_head": (49152, 576)},
    "bert-base": {"qkv": (2304, 768), "o": (768, 768), "up": (3072, 768), "down": (768, 3072)},
}


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    if rows < cpu_linear.PADDED_ROWS:
        x = torch.cat((x, x.new_zeros((cpu_linear.PADDED_ROWS - rows, x.shape[1]))))
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")[:rows]


def paths(rows: int) -> dict:
    out = {"onednn": _onednn, "onednn packed": _onednn, "F.linear": F.linear}
    if rows <= cpu_ops.MAX_LINEAR_ROWS and cpu_ops.library() is not None:
        out = {"kernel": cpu_ops.linear, **out}
    if cpu_ops.library() is not None:
        out = {"panels": cpu_ops.panel_linear, **out}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(MODELS), default="191m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = MODELS[args.model]
    weights = {name: torch.randn(shape, generator=gen) / 32 for name, shape in shapes.items()}
    packed = {name: torch.ops.mkldnn._reorder_linear_weight(w, None) for name, w in weights.items()}
    panels = {name: cpu_ops.PanelWeight(w) for name, w in weights.items()} if cpu_ops.library() is not None else {}
    print(f"{args.threads} threads; ms for the whole set (best of {args.rounds} rounds), GFLOP/s")
    for rows in args.rows:
        x = {name: torch.randn(rows, w.shape[1], generator=gen) for name, w in weights.items()}
        flops = sum(2 * rows * w.numel() for w in weights.values())
        best = {}
        for _ in range(args.rounds):
            for path, fn in paths(rows).items():
                ws = packed if path == "onednn packed" else panels if path == "panels" else weights
                t0 = time.perf_counter()
                for name in shapes:
                    fn(x[name], ws[name])
                best[path] = min(best.get(path, float("inf")), time.perf_counter() - t0)
        print(f"rows {rows:4d}: " + "  ".join(f"{p} {t * 1e3:7.2f} ms {flops / t / 1e9:5.0f}" for p, t in best.items()),
              flush=True)


if __name__ == "__main__":
    main()
