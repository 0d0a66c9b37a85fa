"""What an engine runs: the model, how it is split and batched, and its KV cache. A field left
out takes its setting (neuron.config), so `neuron serve`, `LLM(...)` and NEURON_* variables agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

from neuron.config import check, from_settings, settings
from neuron.errors import ConfigError


def _prefix_caching() -> bool | None:
    """None: on for every model whose layers can share prefixes; NEURON_NO_PREFIX_CACHING turns it off."""
    return False if settings().no_prefix_caching else None


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")

# EngineConfig fields bounded like the setting they default to (field: setting).
_CHECKED = {"task": "task", "tp": "tp", "dtype": "dtype", "quantization": "quantization", "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
            "max_num_batched_tokens": "max_num_batched_tokens", "prefill_chunk_tokens": "prefill_chunk_tokens",
            "block_size": "kv_block_size", "kv_cache_dtype": "kv_cache_dtype", "gpu_memory_utilization": "gpu_memory_utilization",
            "load_timeout_s": "load_timeout_s",
            "max_loras": "max_loras", "max_lora_rank": "max_lora_rank"}


@dataclass(slots=True)
class EngineConfig:
    """What the engine runs. A field left out takes its setting (neuron.config: NEURON_* or the
    table's default) as it stands when the config is built."""

    model: str | None = from_settings("model")  # path or repo id; None serves the embedded default
    task: str = from_settings("task")  # engine/pooling.py: what the model serves (generate, embed or both)
    tp: int = from_settings("tp")
    hosts: str | None = from_settings("hosts")  # ranks on other hosts (executor.placement)
    worker_launcher: str = from_settings("worker_launcher")
    cluster_address: str | None = from_settings("cluster_address")
    cluster_interface: str | None = from_settings("cluster_interface")
    cluster_port: int = from_settings("cluster_port")
    device: str | None = from_settings("device")  # None: cuda when present, else cpu
    devices: list[str] | None = None  # each rank's device, when placed (a model host's placement)
    dtype: str = from_settings("dtype")
    quantization: str | None = from_settings("quantization")  # "int8": quantize at load
    speculative_config: dict | str | None = from_settings("speculative_config")  # speculative.SpeculativeConfig
    max_model_len: int | None = from_settings("max_model_len")  # None: the model's limit, capped
    max_num_seqs: int = from_settings("max_num_seqs")
    max_num_batched_tokens: int | None = from_settings("max_num_batched_tokens")
    prefill_chunk_tokens: int = from_settings("prefill_chunk_tokens")
    hf_cache_dir: str | None = None
    tokenizer: str | None = from_settings("tokenizer")  # a folder or cached repo whose tokenizer to use
    chat_template: str | None = from_settings("chat_template")  # a file or Jinja text over the tokenizer's
    hf_overrides: dict | str | None = from_settings("hf_overrides")  # merged into config.json (JSON text or a dict)
    served_model_name: str | None = from_settings("served_model_name")
    block_size: int = from_settings("kv_block_size")
    kv_cache_memory: int | str | None = from_settings("kv_cache_memory")  # per rank, bytes or "4GiB"
    kv_cache_dtype: str = from_settings("kv_cache_dtype")  # "auto": the model dtype
    gpu_memory_utilization: float = from_settings("gpu_memory_utilization")
    enable_prefix_caching: bool | None = field(default_factory=_prefix_caching)  # True: refuse models without it
    load_timeout_s: float = from_settings("load_timeout_s")
    enable_lora: bool = from_settings("enable_lora")  # LoRA adapters (engine/lora.py)
    max_loras: int = from_settings("max_loras")
    max_lora_rank: int = from_settings("max_lora_rank")
    lora_modules: str | list | dict | None = from_settings("lora_modules")  # adapters served from the start

    def __post_init__(self) -> None:
        for name, setting in _CHECKED.items():
            check(setting, getattr(self, name), name)
        if self.device is not None:
            check_device(self.device)
        if self.devices is not None:
            if len(self.devices) != self.tp:
                raise ConfigError(f"devices names {len(self.devices)} device(s) for {self.tp} rank(s): name one per rank")
            for device in self.devices:
                check_device(device)
        self.hf_overrides = parse_overrides(self.hf_overrides)
        if self.lora_modules:
            parse_lora_modules(self.lora_modules)  # refused here, before anything loads
            self.enable_lora = True


def parse_lora_modules(value: str | list | dict | None) -> list[tuple[str, str]]:
    """`--lora-modules`: NAME=PATH entries separated by spaces or commas; a models file may give
    them as a list of such entries or as a {name: path} mapping."""
    if isinstance(value, dict):
        value = [f"{name}={path}" for name, path in value.items()]
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value))
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"lora_modules takes NAME=PATH entries, got {value!r:.120}")
    modules = []
    for entry in (value or "").replace(",", " ").split():
        name, eq, path = entry.partition("=")
        if not (name and eq and path):
            raise ConfigError(f"--lora-modules takes NAME=PATH entries, got {entry!r:.120}")
        if name in dict(modules):
            raise ConfigError(f"--lora-modules names the adapter {name!r} twice")
        modules.append((name, path))
    return modules


def parse_overrides(value: dict | str | None) -> dict | None:
    """`hf_overrides` as a dict: a JSON object's text is parsed; anything but an object is refused."""
    return json_object(value, "hf_overrides", " (keys of config.json)")


def json_object(value: dict | str | None, name: str, of: str = "") -> dict | None:
    """Setting `name` as a dict: a JSON object's text is parsed, None stays None, anything else is
    refused (`of` says what the object holds)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} must be a JSON object; {exc}") from None
        except RecursionError:
            raise ConfigError(f"{name} nests its JSON too deeply") from None
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object{of}, got {value!r:.80}")
    return value


def check_device(device: str) -> None:
    """Refuse, in one line before any rank starts, a device this torch cannot give: a rank would
    otherwise fail deep inside torch (a CPU build has no `torch._C._cuda_setDevice`)."""
    if not _DEVICE.fullmatch(device):
        raise ConfigError(f"device must be cpu, cuda or cuda:N (N a GPU index), got {device!r}")
    if device == "cpu":
        return
    index = device.partition(":")[2]
    if torch.version.cuda is None:
        raise ConfigError(f"device {device}: this torch ({torch.__version__}) is a build without CUDA; install a CUDA "
                          "build (https://pytorch.org/get-started/locally/; `./run` picks one on a machine with an "
                          "NVIDIA GPU), or use --device cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(f"device {device}: torch (CUDA {torch.version.cuda}) sees no GPU; check `nvidia-smi` and "
                          "CUDA_VISIBLE_DEVICES, or use --device cpu")
    if index and int(index) >= count:
        raise ConfigError(f"device {device}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
