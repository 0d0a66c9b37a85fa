"""The CPU paged-attention kernel (`csrc/paged_attention_cpu.cpp`), called through ctypes.

The library is built on first use (and by `./run install`) with the system compiler and cached
per machine (neuron.utils.native). Where it cannot be built, `library()` is None after one
warning and attention runs the PyTorch reference. The kernel takes fp32, bf16 and fp16 pools (a
16-bit pool under fp32 queries too: an fp32 model's 16-bit KV cache); it computes in fp32
whatever the storage type. `python -m neuron.layers.cpu_attention` builds it
and prints where it lies.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from neuron.layers import cpu_ops
from neuron.utils import native

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's dtype codes
_INTS = ("num_seqs", "heads", "kv_heads", "head_dim", "block_size", "table_stride", "q_stride_t", "q_stride_h",
         "out_stride_t", "out_stride_h", "pool_stride_h", "pool_stride_row")


class _Args(ctypes.Structure):
    """The kernel's `Args`, field for field."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("out", "q", "k_pool", "v_pool", "block_tables", "query_start",
                                                       "kv_lens")]
                + [(name, ctypes.c_int64) for name in _INTS] + [("scale_log2", ctypes.c_float)])


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built if this machine has none yet; None where it cannot be built."""
    lib = native.load(SOURCE, "CPU paged attention falls back to the PyTorch reference")
    if lib is not None:
        lib.neuron_paged_attention.argtypes = [ctypes.POINTER(_Args), ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.neuron_paged_attention.restype = ctypes.c_int
    return lib


def supports(q: torch.Tensor, pool_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel takes these queries over pools of `pool_dtype` (None: the queries'): CPU
    tensors of a dtype it knows, the pools the queries' type or, for fp32 queries, any 16-bit type
    it knows, once it is built."""
    pool_dtype = pool_dtype or q.dtype
    return (q.device.type == "cpu" and q.dtype in DTYPES and pool_dtype in DTYPES
            and (pool_dtype == q.dtype or q.dtype == torch.float32) and library() is not None)


def paged_attention_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, query_start: torch.Tensor,
                        kv_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                        scale: float) -> torch.Tensor:
    """Causal attention of the step's queries ([T, heads, head_dim]) over the pools, as
    paged_attention_reference computes it. The caller has checked the pools' shapes and strides."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    tables = block_tables.contiguous()
    starts, lens = query_start.contiguous(), kv_lens.contiguous()
    args = _Args(out.data_ptr(), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(),
                 starts.data_ptr(), lens.data_ptr(), kv_lens.shape[0], q.shape[1], k_pool.shape[0], q.shape[2],
                 block_size, tables.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                 k_pool.stride(0), k_pool.stride(1), scale * math.log2(math.e))
    status = library().neuron_paged_attention(ctypes.byref(args), DTYPES[q.dtype], DTYPES[k_pool.dtype],
                                              cpu_ops.threads_for(q.shape[0]))
    if status != 0:
        raise ValueError(f"the CPU attention kernel refused queries of {q.dtype} over a {k_pool.dtype} pool "
                         f"(status {status})")
    return out


if __name__ == "__main__":
    if library() is None:
        raise SystemExit("the CPU attention kernel could not be built here; see the warning above")
    print(native.build(SOURCE))
