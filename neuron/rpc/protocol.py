"""The leader <-> worker wire protocol: one JSON object per line, tagged by `op`.

Every request carries an integer `seq`; its reply echoes it. A reply whose `seq` is not the one
awaited is stale and is discarded by the leader. Adding an op is how the protocol evolves.
This module never imports torch: the mock workers and fuzzers speak it without it.
"""

from __future__ import annotations

import msgspec

from neuron.step import SeqStep, VerifyShape

PROTOCOL_VERSION = 8


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


class Message(msgspec.Struct, tag_field="op", tag=_snake, omit_defaults=True):
    seq: int


# ---- requests (leader -> worker) ------------------------------------------------------------


class Ping(Message):
    """Liveness and identity check; answered with `pong`."""


class Init(Message):
    """Join the communicator. `comm_id` is the NCCL unique id (hex) or the gloo store address."""

    backend: str
    comm_id: str
    timeout_s: float
    cpu_bind: list[list[int]] = []  # each rank's cores (executor/cpu_bind.py); empty: not bound
    shm_slot_bytes: int = 0  # backend shm: bytes of a rank's slot, the largest all-reduce of a step (0: the default)


class CommSanityCheck(Message):
    """All-reduce a 1 on every rank; the reply's sum must equal the world size."""


class CheckKernels(Message):
    """Check this rank's fused CUDA kernels at the model's widths (`config_json`) and `dtype`; the
    reply names the ones that failed (none on a CPU rank). Cached per card, so usually instant."""

    config_json: str
    dtype: str


class ShardSpec(msgspec.Struct, frozen=True):
    """What every rank loads: the model (its config, as the leader's ModelConfig resolved it), its
    weight files and how to hold them, and the KV block pool. The pool holds `kv_cache_bytes` when
    set; otherwise on CUDA this rank's `gpu_memory_utilization` share of its device minus weights
    and an activation reserve for steps of `max_num_batched_tokens`, and on CPU `max_slots`
    sequences of `max_model_len` tokens. Derived whole from the ModelConfig, so a field added here
    and there reaches every rank."""

    config_json: str
    weight_paths: list[str]
    dtype: str
    max_slots: int
    max_model_len: int
    block_size: int
    kv_cache_bytes: int  # 0: size the pool as the docstring says
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    quantization: str = ""  # "int8", "fp8": each rank quantizes its linear-layer slices as it reads them
    stored_format: dict | None = None  # a checkpoint stored quantized: its format (models.quant_formats)
    vision: dict | None = None  # how the model takes images (multimodal.image.VisionSpec's fields)
    verify: VerifyShape = VerifyShape()  # speculative decoding's verifying steps (CUDA graphs)
    max_loras: int = 0  # LoRA adapters the rank's pool holds at once (0: no adapters)
    max_lora_rank: int = 0  # the largest adapter rank the pool takes
    kv_cache_dtype: str = ""  # what the KV pool holds ("float16", "bfloat16"); "": the model dtype
    # Rank 0 on CUDA, sized from free memory: speculative decoding's draft loads on its device after
    # it, with a block for each of this pool's and its weights and graphs besides; the pool leaves room
    draft_block_bytes: int = 0
    draft_bytes: int = 0


class LoadShard(Message):
    """Load this rank's share of the model and allocate its KV block pool; the reply says how many
    blocks fit."""

    model_id: str
    shard: ShardSpec
    failed_kernels: dict[str, str] = {}  # the union of every rank's CheckKernels: these run their references


class ForwardStep(Message):
    """Run one batched forward: decodes, prompt chunks, and prompt chunks with images alike (a
    sequence's first step carries its images, see `SeqStep`). Workers reply `forward_step_ok`;
    only rank 0 keeps logits."""

    model_id: str
    seqs: list[SeqStep]


class LoadLora(Message):
    """Put LoRA adapter `lora_id` (the leader's number for one loading of it) in slot `slot` of
    the model's adapter pool: from the rank's host copy, read from the PEFT folder `path` the
    first time. The leader checked the adapter against the model before sending this."""

    model_id: str
    slot: int
    lora_id: int
    path: str


class ForgetLora(Message):
    """Drop the host copy of adapter `lora_id` and empty the slots holding it (it was unloaded)."""

    model_id: str
    lora_id: int


class ClearKvCache(Message):
    """Forget the block tables of these slots (all slots when `slots` is absent)."""

    model_id: str
    slots: list[int] | None = None


class UnloadModel(Message):
    """Drop a model's weights and KV cache."""

    model_id: str


class Shutdown(Message):
    """Reply `bye` and exit 0."""


# ---- replies (worker -> leader) -------------------------------------------------------------


class Pong(Message):
    rank: int
    world_size: int
    device: str
    protocol: int = PROTOCOL_VERSION


class InitOk(Message):
    backend: str


class SanityResult(Message):
    observed_sum: float


class KernelsChecked(Message):
    failed: dict[str, str] = {}  # piece -> why it runs its reference


class LoadShardOk(Message):
    model_id: str
    weight_bytes: int = 0
    kv_bytes: int = 0  # the KV pool
    resident_bytes: int = 0  # the rank's process once loaded (VmRSS; 0 where unknown)
    num_kv_blocks: int = 0  # the leader schedules with the smallest pool of all ranks


class ForwardStepOk(Message):
    elapsed_ms: float = 0.0


class KvCacheCleared(Message):
    pass


class LoraLoaded(Message):
    pass


class Unloaded(Message):
    model_id: str


class Bye(Message):
    pass


class Error(Message):
    """Any request may get this instead. `kind` is a short machine tag (see ErrorKind)."""

    kind: str
    message: str


class ErrorKind:
    BAD_REQUEST = "bad_request"
    UNKNOWN_OP = "unknown_op"
    LINE_TOO_LONG = "line_too_long"
    COMM_INIT_FAILED = "comm_init_failed"
    NOT_INITIALISED = "not_initialised"
    MODEL_NOT_LOADED = "model_not_loaded"
    LOAD_FAILED = "load_failed"
    UNSUPPORTED_ARCH = "unsupported_arch"
    FORWARD_FAILED = "forward_failed"
    INTERNAL = "internal"


Request = (
    Ping
    | Init
    | CommSanityCheck
    | CheckKernels
    | LoadShard
    | ForwardStep
    | LoadLora
    | ForgetLora
    | ClearKvCache
    | UnloadModel
    | Shutdown
)
Reply = (
    Pong | InitOk | SanityResult | KernelsChecked | LoadShardOk | ForwardStepOk | KvCacheCleared | LoraLoaded | Unloaded
    | Bye | Error
)

REQUEST_OPS = frozenset(t.__struct_config__.tag for t in Request.__args__)
REPLY_OPS = frozenset(t.__struct_config__.tag for t in Reply.__args__)
