"""Sparse mixture-of-experts feed-forward block, tensor-parallel.

Every rank holds every expert, each cut along its intermediate dimension like a dense MLP: gate and
up column-parallel, down row-parallel. A token's partial outputs from all its experts are summed
locally, so the block costs one all-reduce, as a dense MLP does. The router is replicated: every
rank routes identically and no routing decision crosses the wire.

Expert weights are stacked at load into [num_experts, ...] tensors. Tokens are sorted by expert and
each expert that received tokens runs one matmul over all of them, so a step's work grows with the
experts hit, not with the experts held.

Expert parallelism fits without touching the checkpoint loader: `SparseMoE.load` reads experts by
id through `_read_expert` (or one fused tensor sliced on dim 0), so a rank holding whole experts
would pass its own `experts` id range and the full intermediate width, and map global expert ids to
local rows after routing (tokens routed elsewhere contribute zeros, and the same all-reduce sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuron.distributed.comm import Communicator
from neuron.layers.tensor_parallel import Reader, Shard, _place


class Router:
    """Top-k softmax routing over a replicated [num_experts, hidden] gate."""

    def __init__(self, weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
        self.weight = weight
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's expert ids [t, k] and their weights [t, k] in x's dtype."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)


def _read_expert(r: Reader, prefix: str, e: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's gate/up rows [start, end) stacked ([2 * n, hidden]) and its down columns [hidden, n]."""
    if r.has(f"{prefix}.gate_up_proj"):  # fused layout: [E, 2 * inter, hidden] and [E, hidden, inter]
        inter = r.read(f"{prefix}.down_proj", 0, e, e + 1).shape[2]
        fused = r.read(f"{prefix}.gate_up_proj", 0, e, e + 1)[0]
        gate_up = torch.cat([fused[start:end], fused[inter + start: inter + end]])
        return gate_up, r.read(f"{prefix}.down_proj", 0, e, e + 1)[0, :, start:end]
    p = f"{prefix}.{e}"
    gate = r.read(f"{p}.gate_proj.weight", 0, start, end)
    up = r.read(f"{p}.up_proj.weight", 0, start, end)
    return torch.cat([gate, up]), r.read(f"{p}.down_proj.weight", 1, start, end)


class SparseMoE:
    """Router plus stacked experts: w_gate_up [E, 2 * inter_local, hidden], w_down [E, hidden, inter_local]."""

    def __init__(self, router: Router, w_gate_up: torch.Tensor, w_down: torch.Tensor, comm: Communicator):
        self.router = router
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self.comm = comm
        self.local_inter = w_down.shape[2]

    @classmethod
    def load(cls, r: Reader, prefix: str, num_experts: int, intermediate: int, top_k: int,
             norm_topk_prob: bool, shard: Shard, comm, dtype, device) -> SparseMoE:
        start, end = shard.even(intermediate, "moe_intermediate_size")
        router = Router(_place(r.read(f"{prefix}.gate.weight"), dtype, device), top_k, norm_topk_prob)
        parts = [_read_expert(r, f"{prefix}.experts", e, start, end) for e in range(num_experts)]
        w_gate_up = _place(torch.stack([g for g, _ in parts]), dtype, device)
        w_down = _place(torch.stack([d for _, d in parts]), dtype, device)
        return cls(router, w_gate_up, w_down, comm)

    def tensors(self) -> list[torch.Tensor]:
        return [self.router.weight, self.w_gate_up, self.w_down]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        self.comm.all_reduce(y)
        return y

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output, before the all-reduce: a model that adds more
        to the block (a shared expert) sums its share in first and reduces once."""
        ids, weights = self.router(x)
        y = self._experts(x, ids.flatten())
        # back to [t, k, hidden], weighted and summed over each token's experts
        return (y.view(*ids.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def _experts(self, x: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair's expert output, in flat_ids' order ([t * k, hidden])."""
        k = flat_ids.numel() // x.shape[0]
        order = torch.argsort(flat_ids, stable=True)
        tokens = x[order // k]
        counts = torch.bincount(flat_ids, minlength=self.w_down.shape[0]).tolist()
        out = torch.empty_like(tokens)
        begin = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(begin, begin + n)
            gate, up = F.linear(tokens[rows], self.w_gate_up[e]).split(self.local_inter, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.w_down[e])
            begin += n
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted
