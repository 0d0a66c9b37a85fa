"""Finding a checkpoint on this machine and reading only this rank's slices of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

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
    """A local directory or GGUF file as is, a repo id ("org/name") found in the local Hugging Face
    cache, optionally followed by a file in it ("org/name/model-Q4_K_M.gguf"), or a model in
    Ollama's local store by its Ollama name ("llama3.2:1b", models/ollama_store.py). A name of a repo
    id's shape is looked for in the Hugging Face cache first."""
    from neuron.models.gguf import is_gguf
    from neuron.models.ollama_store import find_model, parse_name, store_dirs

    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and is_gguf(path)):
        return path.resolve()
    if path.exists():
        raise ModelNotFound(f"{model} is a file but not a GGUF one; pass the checkpoint's directory or a GGUF file")
    ollama = parse_name(model) is not None
    # not a repo id's org/name, nor org/name/file.gguf
    ollama_shaped = ollama and (model.count("/") != 1 or ":" in model) and not model.endswith(".gguf")
    if ollama_shaped and (blob := find_model(model)) is not None:
        return blob
    if _is_path(model):
        raise ModelNotFound(f"model path {model} does not exist")
    repo, file = model, None
    if model.endswith(".gguf") and model.count("/") >= 2:  # org/name/file.gguf
        org, name, file = model.split("/", 2)
        repo = f"{org}/{name}"
    searched = []
    for cache in hub_cache_dirs(cache_dir):
        repo_dir = cache / f"models--{repo.replace('/', '--')}"
        if cache.is_dir():  # a cache that is not there is not worth naming
            searched.append(str(cache))
        if repo_dir.is_dir() and (snap := _snapshot(repo_dir, revision)) is not None:
            if file is None:
                return snap
            if (snap / file).is_file():
                return snap / file
            raise ModelNotFound(f"{file} is not in {repo} ({snap}); its GGUF files: "
                                f"{', '.join(sorted(p.name for p in snap.glob('*.gguf'))) or 'none'}")
    if ollama and not ollama_shaped and (blob := find_model(model)) is not None:  # org/name: Ollama's second
        return blob
    looked = f"looked in: {', '.join(searched)}" if searched else "this machine has no Hugging Face cache"
    if ollama_shaped:
        stores = ", ".join(str(s) for s in store_dirs() if s.is_dir()) or "none on this machine"
        raise ModelNotFound(
            f"model {model!r} is neither a local path nor a model in Ollama's store ({stores}). neuron does not "
            f"download: fetch it first with `ollama pull {model}`, or pass a local path.")
    raise ModelNotFound(
        f"model {model!r} is neither a local path nor a repo in the local Hugging Face cache ({looked}). neuron "
        f"does not download: fetch it first with `hf download {repo}`, or pass a local path."
    )


def _is_path(model: str) -> bool:
    """Whether `model` can only be meant as a path: absolute, relative to here or home, or more than
    org/name (a repo id with a GGUF file name is told apart by its .gguf ending)."""
    return model.startswith(("/", "./", "../", "~", ".\\")) or (model.count("/") > 1 and not model.endswith(".gguf")) \
        or model in (".", "..")


MAX_JSON_BYTES = 64 * 2**20  # config, index and tokenizer settings files; real ones are kilobytes to megabytes


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file, refused in one line (naming it) when missing, huge, nested without
    end, or not JSON."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ConfigError(f"{path} is {path.stat().st_size} bytes, more than a checkpoint's JSON file holds "
                              f"({MAX_JSON_BYTES} at most)")
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{path.name} is missing in {path.parent}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests its JSON too deeply") from None
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None


def weight_files(model_path: Path) -> list[Path]:
    """The files a checkpoint's weights live in: its GGUF file, or its safetensors files."""
    from neuron.models.gguf import find_gguf

    gguf = find_gguf(Path(model_path))
    return [gguf] if gguf is not None else safetensors_files(Path(model_path))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those named by its index (each inside the checkpoint's
    directory), or every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{index}: weight_map must map tensor names to file names")
        files = [_inside(model_dir, n, index) for n in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no .safetensors weights in {model_dir} (other formats are not supported)")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"weight files named by the index are missing: {', '.join(missing)}")
    return files


def _inside(model_dir: Path, name: str, index: Path) -> Path:
    """`name` as a .safetensors file under the checkpoint's directory; a path that leads out of it
    (absolute, or through `..`) is refused. Judged on the name as written: the Hugging Face cache
    links every file to its blob elsewhere, which is the directory owner's doing, not the index's."""
    parts = Path(os.path.normpath(name)).parts
    if not name or Path(name).is_absolute() or ".." in parts or not name.endswith(".safetensors"):
        raise ConfigError(f"{index}: weight_map names {name!r}, which is not a .safetensors file inside {model_dir}")
    return model_dir / name


class CheckpointReader(Reader):
    """Reads tensors or slices of them across a checkpoint's safetensors files. A slice read never
    materialises the full tensor, so a rank holds only its own share. A file that safetensors cannot
    read is refused naming it, in one line."""

    def __init__(self, paths: list[str | Path]):
        self._files = []
        self._where: dict[str, tuple[object, str, str]] = {}  # tensor name: (open file, its name, stored name)
        for path in paths:
            f = _safetensors(path, lambda p: safe_open(str(p), framework="pt", device="cpu"))
            self._files.append(f)
            self._where.update((name, (f, Path(path).name, name)) for name in f.keys())
        if "model.embed_tokens.weight" not in self._where and "embed_tokens.weight" in self._where:
            # the base model saved alone (sentence-transformers' Qwen3-Embedding): names without the
            # `model.` prefix the causal LM's carry, and no LM head
            self._where = {f"model.{name}": where for name, where in self._where.items()}

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def source(self, name: str) -> str:
        return self._where[name][1] if name in self._where else "the checkpoint"

    def _file(self, name: str):
        if name not in self._where:
            raise ConfigError(f"weight {name!r} is missing from the checkpoint")
        return self._where[name][0]

    def shape(self, name: str) -> list[int]:
        f, stored = self._file(name), self._where[name][2]
        return _safetensors(self.source(name), lambda _: list(f.get_slice(stored).get_shape()), name)

    def dtype(self, name: str) -> str:
        """The tensor's dtype as the file names it ("F32", "BF16", "I32", ...)."""
        f, stored = self._file(name), self._where[name][2]
        return _safetensors(self.source(name), lambda _: str(f.get_slice(stored).get_dtype()), name)

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The tensor `name`, or its [start, end) along `dim`, in memory of its own: safetensors hands
        whole tensors out as views of its mapping of the file, and one such view kept (a norm's
        weight) kept the whole file mapped, with every page the rank's slices had read resident."""
        f, stored = self._file(name), self._where[name][2]
        if dim is None:
            return _safetensors(self.source(name), lambda _: f.get_tensor(stored).clone(), name)

        def sliced(_) -> torch.Tensor:
            sl = f.get_slice(stored)
            shape = sl.get_shape()
            stop = shape[dim] if end is None else end
            return sl[tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))]

        return _safetensors(self.source(name), sliced, name)

    def close(self) -> None:
        self._files.clear()
        self._where.clear()


def _safetensors(path, op, tensor: str | None = None):
    """`op(path)`, with safetensors' own errors (a corrupt header, a dtype it does not know, data
    past the end of the file) refused in one line naming the file and the tensor."""
    try:
        return op(path)
    except (OSError, ValueError, RuntimeError, TypeError, SafetensorError) as exc:
        what = f"{Path(str(path)).name}" + (f": tensor {tensor}" if tensor else "")
        raise ConfigError(f"{what}: not readable as safetensors: {str(exc).splitlines()[0] if str(exc) else exc!r}") \
            from None


class QuantizingReader(Reader):
    """A reader whose linear-layer weights come out quantized (`--quantization int8` or `fp8`): each
    slice is quantized as it is read, so a rank never holds more than one dense tensor at a time.
    int8 takes the LM head too, as 8-bit GGUF files hold theirs: at batch 1 a step reads the head
    once per token, and for a small model it is a third of the bytes. fp8 leaves the head dense."""

    def __init__(self, inner: Reader, method: str):
        if method not in quantized.QUANTIZERS:
            raise ConfigError(f"quantization {method!r} is not supported (supported: {', '.join(quantized.QUANTIZERS)})")
        self.inner = inner
        self.method = method
        self.quantize = quantized.QUANTIZERS[method]

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def shape(self, name: str) -> list[int] | None:
        return self.inner.shape(name)

    def source(self, name: str) -> str:
        return self.inner.source(name)

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.inner.read(name, dim, start, end)

    def read_weight(self, name, dim=None, start=0, end=None, vocab=False):
        w = self.inner.read_weight(name, dim, start, end, vocab)
        if vocab or not isinstance(w, torch.Tensor) or w.dim() != 2:
            return w
        return self.quantize(w)

    def head_weight(self, w):
        w = self.inner.head_weight(w)
        if self.method not in quantized.HEAD_QUANTIZATIONS or not isinstance(w, torch.Tensor):
            return w
        return self.quantize(w)

    def close(self) -> None:
        self.inner.close()


def open_checkpoint(paths: list[str], config: dict, quantization: str = "", stored: dict | None = None) -> Reader:
    """This rank's reader over the checkpoint's weight files: a GGUF file's, or safetensors ones
    (kept quantized in the `stored` format, quant_formats.stored_format), quantizing at load where
    asked, each read checked against the shapes the model's `config` implies (weight_shapes)."""
    from neuron.models.gguf import GGUFReader, is_gguf
    from neuron.models.quant_formats import PrequantizedReader
    from neuron.models.weight_shapes import CheckedReader, expected_shapes

    if len(paths) == 1 and is_gguf(Path(paths[0])):
        reader = GGUFReader(paths[0], config)
    else:
        reader = CheckpointReader(paths)
        if stored is not None:
            reader = PrequantizedReader(reader, stored)
    if quantization:
        reader = QuantizingReader(reader, quantization)
    return CheckedReader(reader, expected_shapes(config))
