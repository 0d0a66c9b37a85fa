"""A CPU fp32 step's decoder layers, all of them in one C++ call (`csrc/cpu_decoder.cpp`).

A small model's decode step is host time: per layer a dozen ctypes calls into the kernels
(cpu_ops, the paged attention) and as many small torch operations, 200-300 microseconds of Python
against a few of arithmetic. Here a plan of every layer's weights, shapes and scratch buffers is
built once per model (`DecoderStack.build`), and a step of up to MAX_ROWS rows runs the whole
layer loop in C, calling the same kernels with the same arguments as the Python layers, so the
numbers are the same bit for bit. A projection's weight may be quantized (the
kernel quantized.py calls for it, chosen once for the plan) or stacked from quantized parts of
different layouts, as a GGUF file mixes them. At tp > 1 the sums of the row-parallel
projections run there too, where the communicator's all-reduce has a C entry point (shared
memory); a gloo group keeps the Python layers. A model served with LoRA adapters hands the plan
its projections' adapter pools (layers/lora.py) and a step the pool slot of each row; the C loop
adds each run of one adapter's rows' (x A^T) B^T after the projection, before its all-reduce.

The plan keeps the tensors it points into, so the pointers stay valid for its life; the model
builds a new plan when its layers or its KV cache are replaced.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neuron.distributed.comm import Communicator
from neuron.layers import cpu_attention, cpu_ops, quantized
from neuron.layers.kept import KeptRows
from neuron.layers.kernels import Kernels
from neuron.layers.lora import LoraPool
from neuron.layers.paged_attention import PagedAttentionMetadata
from neuron.utils import native

SOURCE = Path(__file__).parent / "csrc" / "cpu_decoder.cpp"

_NORMS = ("input_norm", "q_norm", "k_norm", "post_norm")
_PROJECTIONS = ("qkv", "o", "gate_up", "down")
_KERNELS = ("linear", "rms_norm", "add_rms_norm", "norm_rope", "silu_mul", "attention", "all_reduce", "abort_word")
_INPUT_OUT_OF_RANGE = 101  # csrc/cpu_decoder.cpp: a token id or position outside its table
# The most rows a step run here may have: a decode batch of up to 64 sequences (the offline
# benchmarks' batch; the loop's host time is paid once a step instead of once a layer). The
# scratch holds that many rows of every activation. A quantized part is multiplied by the kernel
# the Python layer calls for it up to quantized.kernel_rows, and past them by the kernel for many
# rows (quantized.many_kernel) where one takes it, as quantized.linear does; a plan with a
# quantized part none takes (FP8 codes) stops at quantized.MAX_KERNEL_ROWS.
MAX_ROWS = 64
_QUANTIZED_ROWS = min(MAX_ROWS, quantized.MAX_KERNEL_ROWS)
_SCRATCH = ("h", "qkv", "q", "k", "attn", "o", "mid", "gate_up", "act", "down", "lora_u")


class _Part(ctypes.Structure):
    _fields_ = [("dense", ctypes.c_void_p), ("layout", ctypes.c_void_p), ("qlinear", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("many", ctypes.c_void_p), ("few", ctypes.c_int64)]


class _Projection(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(_Part)), ("count", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("stack", ctypes.c_void_p)]


class _Lora(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("width", ctypes.c_int64), ("rank", ctypes.c_int64),
                ("parts", ctypes.c_void_p)]


class _LayerWeights(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in _NORMS] + [(name, _Projection) for name in _PROJECTIONS]
                + [("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p)]
                + [(f"{name}_lora", _Lora) for name in _PROJECTIONS])


class _Plan(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in _KERNELS]
                + [(name, ctypes.c_int64) for name in ("rank", "timeout_ms")]
                + [("layers", ctypes.POINTER(_LayerWeights))]
                + [(name, ctypes.c_int64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim",
                                                       "inter", "pool_stride_h", "pool_stride_row", "kv_dtype")]
                + [("eps", ctypes.c_float), ("scale_log2", ctypes.c_float)]
                + [(f"{name}_buf", ctypes.c_void_p) for name in _SCRATCH]
                + [("final_norm", ctypes.c_void_p), ("head", _Projection), ("head_rows", ctypes.c_int64)]
                + [(name, ctypes.c_void_p) for name in ("embed_dense", "embed_layout", "embed_qrows")]
                + [("embed_rows", ctypes.c_int64), ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p),
                   ("rope_len", ctypes.c_int64)]
                + [(name, ctypes.c_void_p) for name in ("x_buf", "cos_buf", "sin_buf")])


class _Step(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in ("x", "out")] + [("rows", ctypes.c_int64)]
                + [(name, ctypes.c_void_p) for name in ("cos", "sin", "write_rows", "block_tables", "query_start",
                                                         "kv_lens")]
                + [(name, ctypes.c_int64) for name in ("num_seqs", "table_stride", "block_size")]
                + [("segment", ctypes.c_void_p), ("threads", ctypes.c_int64), ("lora_slots", ctypes.c_void_p),
                   ("logits", ctypes.c_void_p), ("token_ids", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                   ("kept", ctypes.c_void_p), ("kept_rows", ctypes.c_int64), ("kept_query_start", ctypes.c_void_p),
                   ("kept_lora_slots", ctypes.c_void_p)])


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, built if this machine has none yet; None where it cannot be built."""
    lib = native.load(SOURCE, "CPU decoder layers run from Python, one kernel call at a time")
    if lib is not None:
        lib.neuron_decoder_layers.argtypes = [ctypes.POINTER(_Plan), ctypes.POINTER(_Step)]
        lib.neuron_decoder_layers.restype = ctypes.c_int
    return lib


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's tensors as the plan takes them: the norms' weights, the merged
    projections' [out, in] weights (fp32, quantized or stacked) and biases (None where the layer
    has none; q_norm and k_norm None without per-head norms) and the layer's K and V pools."""

    input_norm: torch.Tensor
    qkv: quantized.Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: quantized.Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: quantized.Weight
    gate_up_bias: torch.Tensor | None
    down: quantized.Weight
    down_bias: torch.Tensor | None
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    lora: dict[str, LoraPool] = field(default_factory=dict)  # each projection's LoRA pool (layers/lora.py), if any


def _fp32(t, *shape: int) -> bool:
    """A dense fp32 CPU tensor of this shape, contiguous: what the kernels are handed as a pointer."""
    return (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()
            and tuple(t.shape) == shape)


def _parts(kernels: Kernels, w, rows: int, inputs: int) -> list[_Part] | None:
    """A projection's weight as the plan's parts, each multiplied as the Python layer multiplies it
    (cpu_linear.linear, quantized.linear); None where that is not the kernel the C loop calls: a
    stacked part in fp32 (F.linear there), an input order of its own, a layout no kernel takes."""
    if isinstance(w, torch.Tensor):
        return [_Part(w.data_ptr(), None, None, rows)] if _fp32(w, rows, inputs) else None
    if isinstance(w, cpu_ops.PanelWeight):
        return [_Part(None, ctypes.addressof(w.layout), _address(cpu_ops.library().neuron_panel_linear), rows)] \
            if w.shape == (rows, inputs) else None
    pieces = w.parts if isinstance(w, quantized.StackedWeight) else [w]
    parts = []
    for q in pieces:
        if not isinstance(q, quantized.QuantizedWeight) or q.input_index is not None or q.shape[1] != inputs:
            return None
        chosen = quantized.cpu_kernel(kernels, q)
        if chosen is None:
            return None
        kernel, layout = chosen
        many = _address(quantized.many_kernel(kernels, q)) if quantized.many_takes(kernels, q) else None
        parts.append(_Part(None, ctypes.addressof(layout), _address(kernel), q.shape[0], many,
                           quantized.kernel_rows(kernels, q)))
    return parts if sum(p.rows for p in parts) == rows else None


def _rows_for(parts) -> int:
    """The most rows of a step these parts are multiplied for in the C loop (MAX_ROWS)."""
    panels = _address(cpu_ops.library().neuron_panel_linear)
    limited = any(p.layout and p.qlinear != panels and not p.many for p in parts)
    return _QUANTIZED_ROWS if limited else MAX_ROWS


def _takes_layer(w: LayerWeights, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> bool:
    """The layer's norms, biases and pools are what the kernels take (its projections: _parts)."""
    qkv = (heads + 2 * kv_heads) * head_dim
    pool = w.k_pool
    return (_fp32(w.input_norm, hidden) and _fp32(w.post_norm, hidden)
            and all(b is None or _fp32(b, n) for b, n in ((w.qkv_bias, qkv), (w.o_bias, hidden),
                                                           (w.gate_up_bias, 2 * inter), (w.down_bias, hidden)))
            and (w.q_norm is None) == (w.k_norm is None)
            and (w.q_norm is None or _fp32(w.q_norm, head_dim) and _fp32(w.k_norm, head_dim))
            and pool.dim() == 3 and pool.shape[0] == kv_heads and pool.shape[2] == head_dim
            and pool.is_cpu and pool.dtype in cpu_attention.DTYPES and pool.stride(-1) == 1
            and w.v_pool.shape == pool.shape and w.v_pool.stride() == pool.stride() and w.v_pool.dtype is pool.dtype
            and all(_fp32(pool.a, *pool.a.shape) and _fp32(pool.bt, *pool.bt.shape) for pool in w.lora.values()))


def _lora(w: LayerWeights, name: str, held: list[torch.Tensor]) -> _Lora:
    """The plan's view of one projection's LoRA pool; the parts' output ranges it points into are
    kept in `held`."""
    pool = w.lora.get(name)
    if pool is None:
        return _Lora()
    held.append(torch.tensor(pool.parts, dtype=torch.int64).reshape(-1))
    return _Lora(pool.a.data_ptr(), pool.bt.data_ptr(), pool.a.shape[1], pool.rank, held[-1].data_ptr())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def _stack(parts) -> int | None:
    """The kernel that multiplies several parts in one call (rounding x once, one parallel region)
    where every part is multiplied by the integer kernel; None otherwise. It declines, and the C
    loop goes part by part, where the parts' layouts differ in what it shares between them."""
    ops = cpu_ops.library()
    integer = _address(ops.neuron_qlinear_int)
    if len(parts) < 2 or any(p.qlinear != integer for p in parts):
        return None
    return _address(ops.neuron_qlinear_int_stack)


class DecoderStack:
    """A model's plan: its layers' pointers and shapes, and the scratch buffers a step writes."""

    def __init__(self, layers: list[LayerWeights], parts: list[dict[str, list[_Part]]], hidden: int, heads: int,
                 kv_heads: int, head_dim: int, inter: int, eps: float, comm: Communicator):
        self.layers, self.comm, self.hidden = layers, comm, hidden  # the tensors stay referenced
        self.head: tuple | None = None  # the final norm and output projection, once attached
        self.vocab, self.eps = 0, eps
        self.inputs: tuple | None = None  # the embedding and rotary tables and their scratch, once attached
        self.parts = [{name: (_Part * len(p))(*p) for name, p in layer.items()} for layer in parts]
        self.lora_parts: list[torch.Tensor] = []  # each LoRA pool's parts' output ranges, pointed into
        self.weights = (_LayerWeights * len(layers))(*[
            _LayerWeights(*[_ptr(getattr(w, name)) for name in _NORMS],
                          *[_Projection(arrays[name], len(arrays[name]), _ptr(getattr(w, f"{name}_bias")),
                                        _stack(arrays[name]))
                            for name in _PROJECTIONS],
                          w.k_pool.data_ptr(), w.v_pool.data_ptr(),
                          *[_lora(w, name, self.lora_parts) for name in _PROJECTIONS])
            for w, arrays in zip(layers, self.parts)])
        self.max_rows = _rows_for(part for layer in parts for p in layer.values() for part in p)
        rows = self.max_rows
        widths = dict(h=hidden, qkv=(heads + 2 * kv_heads) * head_dim, q=heads * head_dim, k=kv_heads * head_dim,
                      attn=heads * head_dim, o=hidden, mid=hidden, gate_up=2 * inter, act=inter, down=hidden,
                      lora_u=max([p.a.shape[1] for w in layers for p in w.lora.values()], default=0))
        self.scratch = {name: torch.empty((rows, widths[name])) for name in _SCRATCH}
        ops, attention = cpu_ops.library(), cpu_attention.library()
        pool = layers[0].k_pool
        self.plan = _Plan(
            _address(ops.neuron_linear), _address(ops.neuron_rms_norm), _address(ops.neuron_add_rms_norm),
            _address(ops.neuron_norm_rope), _address(ops.neuron_silu_mul), _address(attention.neuron_paged_attention),
            None, None, comm.rank, 0, self.weights, len(layers), hidden, heads, kv_heads, head_dim, inter,
            pool.stride(0), pool.stride(1), cpu_attention.DTYPES[pool.dtype], eps,
            1.0 / math.sqrt(head_dim) * math.log2(math.e),
            *[t.data_ptr() for t in self.scratch.values()])

    @classmethod
    def build(cls, layers: list[LayerWeights], hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
              eps: float, comm: Communicator, kernels: Kernels) -> DecoderStack | None:
        """The plan for these layers (this rank's heads and MLP width), or None where one of them is
        not what the C loop runs (a weight neither fp32 nor in a layout the quantized kernels take
        under `kernels`, an odd head size), the kernels are not built here, or the ranks sum
        through a communicator without a C entry point."""
        if (not layers or head_dim % 2 or library() is None or cpu_ops.library() is None
                or cpu_attention.library() is None):
            return None
        if comm.world_size > 1 and comm.native_all_reduce() is None:
            return None
        if not all(_takes_layer(w, hidden, heads, kv_heads, head_dim, inter) for w in layers):
            return None
        shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                  "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        parts = [{name: _parts(kernels, getattr(w, name), *shapes[name]) for name in _PROJECTIONS} for w in layers]
        if any(p is None for layer in parts for p in layer.values()):
            return None
        pools = {(w.k_pool.stride(0), w.k_pool.stride(1), w.k_pool.dtype) for w in layers}
        if len(pools) != 1:
            return None
        return cls(layers, parts, hidden, heads, kv_heads, head_dim, inter, eps, comm)

    def attach_head(self, norm: torch.Tensor, eps: float, weight: quantized.Weight, vocab: int,
                    kernels: Kernels) -> bool:
        """Let a step end with the model's final norm and output projection (`run(with_logits=True)`),
        at tp 1 where that projection's rows are the whole vocabulary, multiplied by the kernel the
        Python head calls (cpu_linear.linear, quantized.linear: the same logits bit for bit);
        whether the plan took them."""
        inputs = self.hidden
        rows = weight.shape[0]
        parts = None if self.comm.world_size > 1 or rows < vocab or not _fp32(norm, inputs) or \
            eps != self.eps else _parts(kernels, weight, rows, inputs)
        if parts is None:
            return False
        self.head = (norm, weight, (_Part * len(parts))(*parts))  # the plan points into these
        self.max_rows = min(self.max_rows, _rows_for(parts))
        self.plan.final_norm, self.plan.head_rows = norm.data_ptr(), rows
        self.plan.head = _Projection(self.head[2], len(parts), None, _stack(self.head[2]))
        self.vocab = vocab
        return True

    def attach_inputs(self, embed: quantized.Weight, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Let a step start from its token ids and positions (`run_tokens`): the embedding table,
        dense fp32 or quantized in a layout the kernels take (its rows dequantized as
        QuantizedWeight.rows does), and the rotary tables [positions, head_dim]; at tp 1, where
        the table holds the whole vocabulary. Whether the plan took them."""
        hidden, head_dim = self.hidden, self.plan.head_dim
        if self.comm.world_size > 1 or not (_fp32(cos, *cos.shape) and _fp32(sin, *cos.shape)) \
                or cos.dim() != 2 or cos.shape[1] != head_dim:
            return False
        if isinstance(embed, torch.Tensor):
            if not _fp32(embed, embed.shape[0], hidden):
                return False
            dense, layout, qrows = embed.data_ptr(), None, None
        elif isinstance(embed, cpu_ops.PanelWeight) and embed.shape[1] == hidden:
            dense, layout, qrows = None, ctypes.addressof(embed.layout), _address(cpu_ops.library().neuron_panel_rows)
        elif isinstance(embed, quantized.QuantizedWeight) and embed.shape[1] == hidden and embed.rows_layout():
            dense, layout, qrows = None, ctypes.addressof(embed.layout), _address(cpu_ops.library().neuron_qrows)
        else:
            return False
        rows = self.max_rows
        self.inputs = (embed, cos, sin, torch.empty((rows, hidden)), torch.empty((rows, head_dim)),
                       torch.empty((rows, head_dim)))  # the plan points into these
        p = self.plan
        p.embed_dense, p.embed_layout, p.embed_qrows, p.embed_rows = dense, layout, qrows, embed.shape[0]
        p.rope_cos, p.rope_sin, p.rope_len = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        p.x_buf, p.cos_buf, p.sin_buf = (t.data_ptr() for t in self.inputs[3:])
        return True

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: PagedAttentionMetadata | None,
            lora_slots: torch.Tensor | None = None, with_logits: bool = False,
            kept: KeptRows | None = None) -> torch.Tensor | None:
        """Every layer over the step's hidden states x ([rows, hidden]) with the step's rotary tables
        and attention metadata, and each row's LoRA slot (`lora_slots`, int64 [rows], -1 for the base
        model; None: no adapters); with `with_logits`, every row's logits [rows, vocab] through the head
        (`attach_head`) instead of the last layer's output. With `kept`, the last layer runs those rows
        alone past storing its keys and values, and the output is theirs. None where the step is not
        one the C loop takes (more rows than the scratch holds, no paged metadata, x not fp32 rows,
        adapters the plan lacks, no head): the caller runs the layers."""
        rows = x.shape[0]
        if (x.dim() != 2 or not x.is_cpu or x.dtype is not torch.float32 or not x.is_contiguous()
                or cos.numel() != sin.numel() or cos.numel() != rows * self.plan.head_dim):
            return None
        kept_lora = None if kept is None or kept.lora is None else kept.lora.per_row
        if kept is not None and (with_logits or kept.index.dtype is not torch.int64 or not kept.index.is_contiguous()
                                 or kept.paged.query_start.dtype is not torch.int32
                                 or (lora_slots is None) != (kept_lora is None)
                                 or kept_lora is not None and (kept_lora.dtype is not torch.int64
                                                               or kept_lora.shape != kept.index.shape)):
            return None
        cos, sin = cos.contiguous(), sin.contiguous()
        out = self._call(rows, meta, lora_slots, with_logits, (x, cos, sin), kept=kept)
        return out if out is None or kept is None else out[: kept.index.shape[0]]

    def run_tokens(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata | None,
                   lora_slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decode step from its token ids and positions (int64 [rows]) to every row's logits, all
        in the one call: `run(embed(token_ids), *rotary.tables(positions), ..., with_logits=True)`,
        the same numbers. None where the plan has no inputs or head attached, or as `run`."""
        rows = token_ids.shape[0]
        if self.inputs is None or not all(t.dtype is torch.int64 and t.dim() == 1 and t.is_contiguous()
                                          and t.shape[0] == rows for t in (token_ids, positions)):
            return None
        return self._call(rows, meta, lora_slots, True, None, (token_ids, positions))

    def _call(self, rows: int, meta: PagedAttentionMetadata | None, lora_slots: torch.Tensor | None,
              with_logits: bool, hidden: tuple | None, tokens: tuple | None = None,
              kept: KeptRows | None = None) -> torch.Tensor | None:
        if (with_logits and not self.plan.head_rows) or meta is None or rows > self.max_rows:
            return None
        if lora_slots is not None and (not self.scratch["lora_u"].shape[1] or lora_slots.dtype is not torch.int64
                                       or not lora_slots.is_contiguous() or lora_slots.shape != (rows,)):
            return None
        reduce = None
        if self.comm.world_size > 1:
            reduce = self.comm.native_all_reduce()
            if reduce is None:  # closed: the Python layers raise what the communicator raises
                return None
            self.plan.all_reduce, self.plan.abort_word = reduce.function, reduce.abort_word
            self.plan.timeout_ms = reduce.timeout_ms
        tables, starts, lens = meta.block_tables.contiguous(), meta.query_start.contiguous(), meta.kv_lens.contiguous()
        write_rows = meta.slot_mapping.contiguous()
        out = torch.empty((rows, self.hidden))
        logits = torch.empty((rows, self.plan.head_rows)) if with_logits else None
        x, cos, sin = (None, None, None) if hidden is None else (t.data_ptr() for t in hidden)
        ids, positions = (None, None) if tokens is None else (t.data_ptr() for t in tokens)
        step = _Step(x, out.data_ptr(), rows, cos, sin, write_rows.data_ptr(), tables.data_ptr(), starts.data_ptr(),
                     lens.data_ptr(), lens.shape[0], tables.stride(0), meta.block_size,
                     None if reduce is None else reduce.segment, cpu_ops.threads_for(rows), _ptr(lora_slots),
                     _ptr(logits), ids, positions)
        if kept is not None:
            starts = kept.paged.query_start.contiguous()
            slots = None if kept.lora is None else kept.lora.per_row.contiguous()
            step.kept, step.kept_rows, step.kept_query_start = kept.index.data_ptr(), kept.index.shape[0], \
                starts.data_ptr()
            step.kept_lora_slots = _ptr(slots)
        status = library().neuron_decoder_layers(ctypes.byref(self.plan), ctypes.byref(step))
        if status != 0:
            if reduce is not None:
                reduce.check(status)
            if status == _INPUT_OUT_OF_RANGE:
                raise IndexError("a token id past the embedding table or a position past the rotary tables")
            raise RuntimeError(f"the CPU decoder layers stopped with status {status}")
        if logits is None:
            return out
        return logits if logits.shape[1] == self.vocab else logits[:, : self.vocab]


if __name__ == "__main__":
    if library() is None:
        raise SystemExit("the CPU decoder layers could not be built here; see the warning above")
    print(native.build(SOURCE))
