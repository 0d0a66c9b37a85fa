"""Finding a checkpoint on this machine and reading only this rank's slices of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from neuron.errors import ConfigError, ModelNotFound
from neuron.layers import quantized
from neuron.layers.tensor_parallel import Reader


def hub_cache_dirs(explicit: str | None = None) -> list[Path]:
    """Where a repo id may live, in order: an explicit setting, HF_HUB_CACHE, HF_HOME/hub, the default."""
    dirs = []
    if explicit:
        dirs.append(Path(explicit))
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def _snapshot(repo_dir: Path, revision: str) -> Path | None:
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = repo_dir / "snapshots" / commit
    if snap.is_dir():
        return snap
    snaps = sorted((repo_dir / "snapshots").glob("*")) if (repo_dir / "snapshots").is_dir() else []
    return snaps[-1] if len(snaps) == 1 else None


def resolve_model_path(model: str, cache_dir: str | None = None, revision: str = "main") -> Path:
    """A local directory or .gguf file as is, or a repo id ("org/name") found in the local Hugging
    Face cache, optionally followed by a file in it ("org/name/model-Q4_K_M.gguf")."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path.resolve()
    if path.exists():
        raise ModelNotFound(f"{model} is a file but not a .gguf one; pass the checkpoint's directory or a GGUF file")
    repo, file = model, None
    if model.endswith(".gguf") and model.count("/") >= 2:  # org/name/file.gguf
        org, name, file = model.split("/", 2)
        repo = f"{org}/{name}"
    searched = []
    for cache in hub_cache_dirs(cache_dir):
        repo_dir = cache / f"models--{repo.replace('/', '--')}"
        searched.append(str(repo_dir))
        if repo_dir.is_dir() and (snap := _snapshot(repo_dir, revision)) is not None:
            if file is None:
                return snap
            if (snap / file).is_file():
                return snap / file
            raise ModelNotFound(f"{file} is not in {repo} ({snap}); its GGUF files: "
                                f"{', '.join(sorted(p.name for p in snap.glob('*.gguf'))) or 'none'}")
    raise ModelNotFound(
        f"model {model!r} is neither a directory nor in the local Hugging Face cache "
        f"(looked in: {', '.join(searched)}). neuron does not download: fetch it first, "
        f"e.g. `hf download {model}`, or pass a local path."
    )


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path.name} is missing in {path.parent}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None


def read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def weight_files(model_path: Path) -> list[Path]:
    """The files a checkpoint's weights live in: its GGUF file, or its safetensors files."""
    from neuron.models.gguf import find_gguf

    gguf = find_gguf(Path(model_path))
    return [gguf] if gguf is not None else safetensors_files(Path(model_path))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those named by its index, or every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no .safetensors weights in {model_dir} (other formats are not supported)")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"weight files named by the index are missing: {', '.join(missing)}")
    return files


class CheckpointReader(Reader):
    """Reads tensors or slices of them across a checkpoint's safetensors files. A slice read never
    materialises the full tensor, so a rank holds only its own share."""

    def __init__(self, paths: list[str | Path]):
        self._files = [safe_open(str(p), framework="pt", device="cpu") for p in paths]
        self._where = {name: f for f in self._files for name in f.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> list[int]:
        f = self._where.get(name)
        if f is None:
            raise ConfigError(f"weight {name!r} is missing from the checkpoint")
        return list(f.get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ConfigError(f"weight {name!r} is missing from the checkpoint")
        if dim is None:
            return f.get_tensor(name)
        sl = f.get_slice(name)
        shape = sl.get_shape()
        end = shape[dim] if end is None else end
        index = tuple(slice(start, end) if d == dim else slice(None) for d in range(len(shape)))
        return sl[index]

    def close(self) -> None:
        self._files.clear()
        self._where.clear()


class QuantizingReader(Reader):
    """A reader whose linear-layer weights come out quantized (`--quantization int8` or `fp8`): each
    slice is quantized as it is read, so a rank never holds more than one dense tensor at a time."""

    def __init__(self, inner: Reader, method: str):
        if method not in quantized.QUANTIZERS:
            raise ConfigError(f"quantization {method!r} is not supported (supported: {', '.join(quantized.QUANTIZERS)})")
        self.inner = inner
        self.quantize = quantized.QUANTIZERS[method]

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.inner.read(name, dim, start, end)

    def read_weight(self, name, dim=None, start=0, end=None, vocab=False):
        w = self.inner.read_weight(name, dim, start, end, vocab)
        if vocab or not isinstance(w, torch.Tensor) or w.dim() != 2:
            return w
        return self.quantize(w)

    def close(self) -> None:
        self.inner.close()


def open_checkpoint(paths: list[str], quantization: str = "", config: dict | None = None) -> Reader:
    """This rank's reader over the checkpoint's weight files: a GGUF file's, or safetensors ones
    (quantized where `config`'s quantization_config says so), quantizing at load where asked."""
    from neuron.models.quant_formats import PrequantizedReader, checkpoint_quantization

    if len(paths) == 1 and str(paths[0]).endswith(".gguf"):
        from neuron.models.gguf import GGUFReader

        reader = GGUFReader(paths[0])
    else:
        reader = CheckpointReader(paths)
        if (spec := checkpoint_quantization(config or {})) is not None:
            reader = PrequantizedReader(reader, spec)
    return QuantizingReader(reader, quantization) if quantization else reader
