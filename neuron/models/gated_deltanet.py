"""Gated DeltaNet: linear attention whose per-sequence memory is a decaying matrix updated by the
delta rule, after a short causal depthwise convolution. Tensor-parallel by heads.

Per value head, with l2-normalised key k and query q, decay g <= 0 and write strength beta:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   out = S^T q

A prompt runs in chunks: within a chunk the updates are solved at once as a unit-lower-triangular
system, and only the [k_dim, v_dim] state is carried from chunk to chunk. A decode step applies
the rule once. Each slot keeps its convolution window and its state on every rank, for that
rank's heads only, so the block's only collective is the row-parallel output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neuron.distributed.comm import Communicator
from neuron.errors import ConfigError
from neuron.layers import cpu_ops
from neuron.layers.kernels import Kernels
from neuron.layers.tensor_parallel import ColumnParallelLinear, Reader, RowParallelLinear, Shard
from neuron.step import SeqStep
from neuron.utils.device import to_device

CHUNK = 64  # tokens solved together in a prompt; bounds the [chunk, chunk] systems


@dataclass(slots=True, frozen=True)
class DeltaNetHeads:
    """How linear-attention heads land on ranks. Value heads split evenly; each value head reads
    key head `v // (num_v_heads / num_k_heads)`, so a rank takes the key heads its value heads
    read: an even share of them, or one key head repeated on the ranks that share its group."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    shard: Shard

    @property
    def group(self) -> int:
        return self.num_v_heads // self.num_k_heads

    @property
    def local_v(self) -> int:
        return self.num_v_heads // self.shard.world

    def validate(self) -> None:
        w = self.shard.world
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        if self.num_v_heads % w:
            raise ConfigError(f"linear_num_value_heads ({self.num_v_heads}) is not divisible by tp={w}")
        if self.local_v % self.group and self.group % self.local_v:
            raise ConfigError(
                f"tp={w} splits linear-attention key-head groups unevenly "
                f"({self.num_k_heads} key heads, {self.num_v_heads} value heads)"
            )

    def v_range(self) -> tuple[int, int]:
        r = self.shard.rank
        return r * self.local_v, (r + 1) * self.local_v

    def k_range(self) -> tuple[int, int]:
        v0, v1 = self.v_range()
        return v0 // self.group, (v1 - 1) // self.group + 1

    def local_k(self) -> int:
        k0, k1 = self.k_range()
        return k1 - k0


class DeltaNetState:
    """Per linear-attention layer and slot: the last `kernel - 1` convolution inputs and the
    recurrent state (float32: it accumulates over the whole sequence). A sequence at offset 0
    starts from zeros, so a reused slot needs no clearing."""

    def __init__(self, layers: int, slots: int, conv_dim: int, kernel: int, heads: DeltaNetHeads, dtype, device):
        self.conv = [torch.zeros(slots, conv_dim, kernel - 1, dtype=dtype, device=device) for _ in range(layers)]
        shape = (slots, heads.local_v, heads.k_dim, heads.v_dim)
        self.recurrent = [torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(layers)]
        self.device = device
        self.begin([])

    @staticmethod
    def bytes_per_slot(layers: int, conv_dim: int, kernel: int, heads: DeltaNetHeads, dtype) -> int:
        conv = conv_dim * (kernel - 1) * torch.finfo(dtype).bits // 8
        return layers * (conv + heads.local_v * heads.k_dim * heads.v_dim * 4)

    def begin(self, seqs: list[SeqStep]) -> None:
        """Record the step's sequences (slot, offset, new tokens) for every layer."""
        self.slots = [s.slot for s in seqs]
        self.offsets = [s.offset for s in seqs]
        self.lengths = [len(s.token_ids) for s in seqs]
        self.all_decode = all(n == 1 for n in self.lengths)
        self.slots_t = to_device(self.slots, self.device, torch.long) if len(seqs) > 1 else None
        fresh = [o == 0 for o in self.offsets]
        self.fresh = to_device(fresh, self.device, torch.bool) if any(fresh) and len(seqs) > 1 else None
        # the fused CPU update's slot rows and fresh flags (cpu_ops.delta_step), once a step
        self.rows = (torch.tensor(self.slots, dtype=torch.int64), torch.tensor(fresh, dtype=torch.uint8)) \
            if self.all_decode and torch.device(self.device).type == "cpu" else None

    def gather(self, state: torch.Tensor) -> torch.Tensor:
        """A decode step's slot states, [B, ...]."""
        if self.slots_t is None:
            s = state[self.slots[0]].unsqueeze(0)
            return s if self.offsets[0] else torch.zeros_like(s)
        s = state[self.slots_t]
        return s if self.fresh is None else s.masked_fill(self.fresh.view(-1, *([1] * (s.dim() - 1))), 0)

    def scatter(self, state: torch.Tensor, values: torch.Tensor) -> None:
        if self.slots_t is None:
            state[self.slots[0]] = values[0]
        else:
            state[self.slots_t] = values

    def sequences(self):
        """(slot, offset, rows of its new tokens in the step) per sequence."""
        start = 0
        for slot, offset, n in zip(self.slots, self.offsets, self.lengths):
            yield slot, offset, slice(start, start + n)
            start += n


class GatedDeltaNet:
    def __init__(self, layer: int, in_proj, conv_weight, neg_a, dt_bias, norm_weight, out_proj, heads, eps):
        self.layer = layer
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv_weight = conv_weight  # [conv_dim, kernel]
        self.neg_a, self.dt_bias = neg_a, dt_bias  # float32 [local_v]
        self.norm_weight, self.eps = norm_weight, eps  # float32 [v_dim]
        self.heads = heads
        nk, nv = heads.local_k(), heads.local_v
        self.qkv_sizes = (nk * heads.k_dim, nk * heads.k_dim, nv * heads.v_dim)
        self.sizes = (sum(self.qkv_sizes), nv * heads.v_dim, nv, nv)
        # out_proj's inputs as a GGUF file orders them (its value heads key head fastest): this rank's
        # heads, grouped by key head here, are handed over in that order
        self.tiled = self.fused = False
        self.tiled_shape = (max(1, nv // heads.group), min(nv, heads.group), heads.v_dim)

    @classmethod
    def load(cls, r: Reader, layer: int, prefix: str, heads: DeltaNetHeads, eps: float, comm: Communicator,
             dtype, device, kernels: Kernels) -> "GatedDeltaNet":
        heads.validate()
        (k0, k1), (v0, v1) = heads.k_range(), heads.v_range()
        dk, dv = heads.k_dim, heads.v_dim
        key_dim = heads.num_k_heads * dk
        # in_proj_qkv's rows are [q heads | k heads | v heads]: this rank's are three runs of them.
        qkv = [(k0 * dk, k1 * dk), (key_dim + k0 * dk, key_dim + k1 * dk),
               (2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv)]
        parts = [(f"{prefix}.in_proj_qkv", a, b) for a, b in qkv]
        parts += [(f"{prefix}.in_proj_z", v0 * dv, v1 * dv), (f"{prefix}.in_proj_b", v0, v1),
                  (f"{prefix}.in_proj_a", v0, v1)]
        in_proj = ColumnParallelLinear.load_ranges(r, parts, dtype, device, kernels)
        conv = torch.cat([r.read(f"{prefix}.conv1d.weight", 0, a, b) for a, b in qkv])
        conv_weight = conv.reshape(conv.shape[0], -1).to(device=device, dtype=dtype).contiguous()
        neg_a = -r.read(f"{prefix}.A_log", 0, v0, v1).float().exp().to(device)
        dt_bias = r.read(f"{prefix}.dt_bias", 0, v0, v1).float().to(device)
        norm_weight = r.read(f"{prefix}.norm.weight").float().to(device)
        out_proj = RowParallelLinear.load(r, f"{prefix}.out_proj", heads.num_v_heads * dv, heads.shard, comm, dtype,
                                          device, kernels)
        block = cls(layer, in_proj, conv_weight, neg_a, dt_bias, norm_weight, out_proj, heads, eps)
        block.tiled = r.inputs_order(f"{prefix}.out_proj.weight") == "tiled"
        # a decode step's state update in one fused pass of the kernel library, where its layers ask for it
        block.fused = kernels.cpu_ops and torch.device(device).type == "cpu"
        return block

    def tensors(self) -> list[torch.Tensor]:
        return [self.in_proj.weight, self.conv_weight, self.neg_a, self.dt_bias, self.norm_weight, self.out_proj.weight]

    def __call__(self, h: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        t, nv, dv = h.shape[0], self.heads.local_v, self.heads.v_dim
        mixed, z, b, a = self.in_proj(h).split(self.sizes, dim=-1)
        mixed = F.silu(self._conv(mixed, state))
        q, k, v = mixed.float().split(self.qkv_sizes, dim=-1)
        q = _expand(_l2norm(q.view(t, -1, self.heads.k_dim)), nv)
        k = _expand(_l2norm(k.view(t, -1, self.heads.k_dim)), nv)
        q = q * self.heads.k_dim**-0.5
        beta = b.float().sigmoid()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        o = self._delta(q, k, v.view(t, nv, dv), g, beta, state)
        o = F.rms_norm(o, (dv,), self.norm_weight, self.eps) * F.silu(z.view(t, nv, dv).float())
        if self.tiled:
            o = o.view(t, *self.tiled_shape).transpose(1, 2)
        return self.out_proj(o.to(h.dtype).reshape(t, -1))

    def _conv(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """Causal depthwise convolution of each sequence's new inputs ([T, C]) continuing its slot's
        window; the window moves on to the newest inputs."""
        w, conv_state = self.conv_weight, state.conv[self.layer]
        if state.all_decode:
            window = torch.cat([state.gather(conv_state), x.unsqueeze(-1)], dim=-1)  # [B, C, kernel]
            state.scatter(conv_state, window[..., 1:])
            return (window * w).sum(-1)
        out = []
        for slot, offset, rows in state.sequences():
            prev = conv_state[slot] if offset else torch.zeros_like(conv_state[slot])
            seq = torch.cat([prev, x[rows].T], dim=-1)  # [C, kernel - 1 + n]
            conv_state[slot] = seq[:, -conv_state.shape[-1] :]
            out.append(F.conv1d(seq.unsqueeze(0), w.unsqueeze(1), groups=w.shape[0])[0].T)
        return out[0] if len(out) == 1 else torch.cat(out)

    def _delta(self, q, k, v, g, beta, state: DeltaNetState) -> torch.Tensor:
        """The gated delta rule over each sequence's new tokens from its slot's state; [T, heads, v_dim]."""
        rec = state.recurrent[self.layer]
        if state.all_decode and self.fused and state.rows is not None:
            o = cpu_ops.delta_step(rec, *state.rows, q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                   beta.contiguous())
            if o is not None:
                return o
        if state.all_decode:
            s, o = delta_step(state.gather(rec), q, k, v, g, beta)
            state.scatter(rec, s)
            return o
        out = []
        for slot, offset, rows in state.sequences():
            s0 = rec[slot] if offset else torch.zeros_like(rec[slot])
            if rows.stop - rows.start == 1:
                s, o = delta_step(s0[None], q[rows], k[rows], v[rows], g[rows], beta[rows])
                s = s[0]
            else:
                s, o = delta_chunked(s0, q[rows], k[rows], v[rows], g[rows], beta[rows])
            rec[slot] = s
            out.append(o)
        return out[0] if len(out) == 1 else torch.cat(out)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key heads to the value heads that read them ([T, k_heads, d] -> [T, heads, d])."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def delta_step(s, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: states [B, H, dk, dv], q/k [B, H, dk], v [B, H, dv], g/beta [B, H]."""
    s = s * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return s, torch.einsum("bhkv,bhk->bhv", s, q)


def delta_chunked(s, q, k, v, g, beta, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's tokens from state s ([H, dk, dv]); q/k [T, H, dk], v [T, H, dv], g/beta [T, H].

    In a chunk with cumulative log decay c_i, the written values u solve
    (I + A) u = beta v - beta exp(c) K S0 with A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i);
    outputs are exp(c_i) S0^T q_i + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j.
    Padding tokens carry k = v = beta = g = 0 and change nothing."""
    t = q.shape[0]
    c = min(chunk, t)
    pad = -t % c
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, T', d]
    g, beta = (F.pad(x.T, (0, pad)) for x in (g, beta))  # [H, T']
    h, n = q.shape[0], q.shape[1] // c
    q, k, v = (x.reshape(h, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(h, n, c), beta.reshape(h, n, c)

    cum = g.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    a = (k @ k.transpose(-1, -2) * decay * beta[..., None]).tril(-1)
    system = a + torch.eye(c, dtype=a.dtype, device=a.device)
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    u_fixed, u_per_state = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], k.shape[-1]], dim=-1
    )
    scores = q @ k.transpose(-1, -2) * decay
    q_from_state = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    end_decay = cum[..., -1].exp()[..., None, None]

    out = torch.empty_like(v)
    for i in range(n):
        u = u_fixed[:, i] - u_per_state[:, i] @ s
        out[:, i] = q_from_state[:, i] @ s + scores[:, i] @ u
        s = s * end_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return s, out.reshape(h, n * c, -1)[:, :t].transpose(0, 1)
