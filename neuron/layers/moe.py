"""Sparse mixture-of-experts feed-forward block, tensor-parallel.

Every rank holds every expert, each cut along its intermediate dimension like a dense MLP: gate and
up column-parallel, down row-parallel. A token's partial outputs from all its experts are summed
locally, so the block costs one all-reduce, as a dense MLP does. The router is replicated: every
rank routes identically and no routing decision crosses the wire.

Expert weights are stacked at load into [num_experts, ...] tensors. A step's (token, expert) pairs
run through one of three computations with the same result (bit for bit in float32 on CPU for
"grouped" and "loop", to rounding for "gather"):

- "grouped": pairs sorted by expert, then one `torch._grouped_mm` per projection over all experts,
  the sorted rows cut into experts by int32 offsets computed on the device (`searchsorted` over the
  sorted ids: `bincount` reads the ids' maximum back to the host on CUDA).
- "gather": each pair's expert weights copied out, one `bmm` per projection over all pairs. It
  reads only the chosen experts, but writes and reads them once more.
- "loop": pairs sorted by expert, one matmul per expert that received pairs, the counts read on the
  host (a synchronisation on a GPU).

`expert_path` chooses, first match wins:

1. CUDA, at most `GATHER_MAX_PAIRS` pairs, grouped_mm unusable or synchronising: "gather". torch runs
   grouped_mm with device offsets only for bfloat16 on sm90/sm100 (its CUTLASS kernel); for other
   dtypes and GPUs it copies the offsets to the host and loops. Gathering keeps decode steps free
   of host synchronisation, so capturable in CUDA graphs, on every GPU and dtype. GPU only: on CPU
   the copies cost more than they save at every size measured.
2. CPU, fewer than one pair per `CPU_LOOP_EXPERTS_PER_PAIR` experts: "loop". grouped_mm on CPU is
   a loop over every expert in C++, empty ones included; the Python loop skips them.
3. grouped_mm usable (a torch that has it; float32, bfloat16 or float16; hidden and local expert
   widths multiples of 16 bytes, i.e. of 4 floats or 8 halves, its stride rule): "grouped". On CUDA
   outside bfloat16 sm90/sm100 this is torch's synchronising fallback, for large steps (prefill).
4. Otherwise "loop".

The CUDA branches follow torch's source (aten/src/ATen/native/cuda/GroupedBlas.cpp) and have not
run on a GPU yet; tests/test_moe.py holds a `gpu` test for them (no synchronisation, graph replay).

On CPU "grouped" was the faster from one pair per 8 experts up to a 512-token step at top-8 (4096
pairs); at 8192 pairs and more the loop mostly was, by 7-19% (its intermediates stay in cache),
which only prefill steps above the default 512-token chunk reach (docs/benchmarks.md).

Expert parallelism fits without touching the checkpoint loader: `SparseMoE.load` reads experts by
id through `_read_expert` (or one fused tensor sliced on dim 0), so a rank holding whole experts
would pass its own `experts` id range and the full intermediate width, and map global expert ids to
local rows after routing (tokens routed elsewhere contribute zeros, and the same all-reduce sums).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from neuron.distributed.comm import Communicator
from neuron.layers import quantized
from neuron.layers.kernels import Kernels
from neuron.layers.norm import silu_mul
from neuron.layers.quantized import Weight
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


def _read_expert(r: Reader, prefix: str, e: int, start: int, end: int) -> tuple[Weight, Weight]:
    """Expert e's gate/up rows [start, end) stacked ([2 * n, hidden]) and its down columns [hidden, n];
    kept quantized where the checkpoint stores them so or the reader quantizes at load."""
    if r.has(f"{prefix}.gate_up_proj"):  # fused layout: [E, 2 * inter, hidden] and [E, hidden, inter]
        inter = r.read(f"{prefix}.down_proj", 0, e, e + 1).shape[2]
        fused = r.read(f"{prefix}.gate_up_proj", 0, e, e + 1)[0]
        gate_up = torch.cat([fused[start:end], fused[inter + start: inter + end]])
        return gate_up, r.read(f"{prefix}.down_proj", 0, e, e + 1)[0, :, start:end]
    p = f"{prefix}.{e}"
    gate = r.read_weight(f"{p}.gate_proj.weight", 0, start, end)
    up = r.read_weight(f"{p}.up_proj.weight", 0, start, end)
    down = r.read_weight(f"{p}.down_proj.weight", 1, start, end)
    if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor):
        return torch.cat([gate, up]), down
    return [gate, up], down  # stacked once the layer knows its device



# Decode-sized steps take the gather path where grouped_mm would synchronise (see the module
# docstring). Its weight copies (pairs x 3 x hidden x local width) are then about what the block's
# activation reservation for a 512-token step holds in Qwen3-MoE shapes (`routed_activation_bytes`);
# 16 pairs is a decode of 2 sequences at top-8, 4 at top-4.
GATHER_MAX_PAIRS = 16
# On CPU grouped_mm costs about 1.4 us per expert even when the expert has no rows, the Python loop
# about 30 us per expert hit: with fewer than one pair per 8 experts (a decode of one sequence at
# 128 experts top-8) the loop is the faster (docs/benchmarks.md).
CPU_LOOP_EXPERTS_PER_PAIR = 8
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expert_path(pairs: int, num_experts: int, device_type: str, dtype: torch.dtype, hidden: int,
                local_inter: int, sync_free_grouped_mm: bool = False) -> str:
    """"grouped", "gather" or "loop" for a step of `pairs` (token, expert) pairs; see the module
    docstring. `sync_free_grouped_mm`: the device runs grouped_mm's kernel (CUDA sm90 or sm100)."""
    row = 16 // dtype.itemsize  # elements in 16 bytes: grouped_mm's stride alignment
    grouped = (hasattr(torch, "_grouped_mm") and dtype in _GROUPED_DTYPES and hidden % row == 0
               and local_inter % row == 0 and (device_type != "cpu" or _grouped_mm_on_cpu(dtype)))
    if device_type == "cuda" and pairs <= GATHER_MAX_PAIRS:
        if not (grouped and sync_free_grouped_mm and dtype == torch.bfloat16):
            return "gather"
    if device_type == "cpu" and pairs * CPU_LOOP_EXPERTS_PER_PAIR < num_experts:
        return "loop"
    return "grouped" if grouped else "loop"


@functools.cache
def _grouped_mm_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this torch has a CPU kernel for grouped_mm in `dtype` (2.8 has the op, CUDA-only):
    asked once, with a two-row product."""
    try:
        a, b = torch.ones(2, 8, dtype=dtype), torch.ones(2, 8, 8, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _sync_free_grouped_mm(device: torch.device) -> bool:
    """torch runs bfloat16 grouped_mm with device offsets on CUDA sm90 and sm100 only (elsewhere it
    copies the offsets to the host and loops)."""
    if device.type != "cuda" or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


class SparseMoE:
    """Router plus stacked experts: w_gate_up [E, 2 * inter_local, hidden], w_down [E, hidden, inter_local];
    or, for quantized experts, lists of one quantized weight per expert, run by the loop path
    through the quantized kernel (neuron/layers/quantized.py)."""

    def __init__(self, router: Router, w_gate_up: torch.Tensor | list, w_down: torch.Tensor | list,
                 comm: Communicator, kernels: Kernels):
        self.router = router
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self.comm = comm
        self.kernels = kernels
        self.quantized = isinstance(w_down, list)
        self.local_inter = w_down[0].shape[1] if self.quantized else w_down.shape[2]
        device = router.weight.device
        self.expert_ids = torch.arange(len(w_down) if self.quantized else w_down.shape[0], device=device)
        self.sync_free_grouped_mm = _sync_free_grouped_mm(device)

    @classmethod
    def load(cls, r: Reader, prefix: str, num_experts: int, intermediate: int, top_k: int,
             norm_topk_prob: bool, shard: Shard, comm, dtype, device, kernels: Kernels) -> SparseMoE:
        start, end = shard.even(intermediate, "moe_intermediate_size")
        router = Router(_place(r.read(f"{prefix}.gate.weight"), dtype, device), top_k, norm_topk_prob)
        parts = [_read_expert(r, f"{prefix}.experts", e, start, end) for e in range(num_experts)]
        if all(isinstance(g, torch.Tensor) and isinstance(d, torch.Tensor) for g, d in parts):
            w_gate_up = _place(torch.stack([g for g, _ in parts]), dtype, device)
            w_down = _place(torch.stack([d for _, d in parts]), dtype, device)
            return cls(router, w_gate_up, w_down, comm, kernels)
        w_gate_up = [quantized.stack(g if isinstance(g, list) else [g], dtype, device) for g, _ in parts]
        w_down = [quantized.stack([d], dtype, device) for _, d in parts]
        return cls(router, w_gate_up, w_down, comm, kernels)

    def tensors(self) -> list[torch.Tensor]:
        experts = [self.w_gate_up, self.w_down] if not self.quantized else \
            [t for w in self.w_gate_up + self.w_down for t in quantized.tensors(w)]
        return [self.router.weight, *experts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        self.comm.all_reduce(y)
        return y

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output, before the all-reduce: a model that adds more
        to the block (a shared expert) sums its share in first and reduces once."""
        ids, weights = self.router(x)
        y = self.experts(x, ids.flatten())
        # back to [t, k, hidden], weighted and summed over each token's experts
        return (y.view(*ids.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)

    def path_for(self, pairs: int) -> str:
        if self.quantized:
            return "loop"
        w = self.w_down
        return expert_path(pairs, w.shape[0], w.device.type, w.dtype, w.shape[1], self.local_inter,
                           self.sync_free_grouped_mm)

    def experts(self, x: torch.Tensor, flat_ids: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """Each (token, expert) pair's expert output, in flat_ids' order ([t * k, hidden]), by
        `path` (the one `expert_path` chooses unless given)."""
        path = path or self.path_for(flat_ids.numel())
        k = flat_ids.numel() // x.shape[0]
        if path == "gather":
            return self._gathered(x, flat_ids, k)
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        # ends[e]: one past expert e's last row among the sorted pairs (int32, as grouped_mm takes it)
        ends = torch.searchsorted(sorted_ids, self.expert_ids, right=True, out_int32=True)
        tokens = x[order // k]
        out = self._grouped(tokens, ends) if path == "grouped" else self._looped(tokens, ends)
        return torch.empty_like(out).index_copy_(0, order, out)

    def _grouped(self, tokens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        gate_up = torch._grouped_mm(tokens, self.w_gate_up.transpose(1, 2), offs=ends)
        gate, up = gate_up.split(self.local_inter, dim=-1)
        return torch._grouped_mm(silu_mul(self.kernels, gate, up), self.w_down.transpose(1, 2), offs=ends)

    def _looped(self, tokens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(tokens)
        begin = 0
        for e, end in enumerate(ends.tolist()):  # the host reads the counts: a sync on a GPU
            if end > begin:
                gate, up = self._linear(tokens[begin:end], self.w_gate_up[e]).split(self.local_inter, dim=-1)
                out[begin:end] = self._linear(silu_mul(self.kernels, gate, up), self.w_down[e])
            begin = end
        return out

    def _linear(self, x: torch.Tensor, w) -> torch.Tensor:
        return quantized.linear(self.kernels, x, w) if self.quantized else F.linear(x, w)

    def _gathered(self, x: torch.Tensor, flat_ids: torch.Tensor, k: int) -> torch.Tensor:
        tokens = x.unsqueeze(1).expand(-1, k, -1).reshape(-1, 1, x.shape[-1])  # [t * k, 1, hidden]
        # each pair's expert weights copied out: [t * k, hidden, 2 * inter] and [t * k, inter, hidden]
        gate, up = torch.bmm(tokens, self.w_gate_up[flat_ids].transpose(1, 2)).split(self.local_inter, dim=-1)
        return torch.bmm(silu_mul(self.kernels, gate, up), self.w_down[flat_ids].transpose(1, 2)).squeeze(1)
