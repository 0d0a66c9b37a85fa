"""Models in Ollama's local store, by the names Ollama gives them (`llama3.2:1b`, `all-minilm`,
`namespace/model:tag`): what people who run Ollama already have on disk, served without a copy.

Ollama keeps a manifest per model and tag, `manifests/<host>/<namespace>/<model>/<tag>` (an OCI-style
JSON file listing the model's layers by digest), and each layer once, as `blobs/sha256-<hex>`. The
weights are the layer of media type `application/vnd.ollama.image.model`: a GGUF file, which the
GGUF reader takes as it is (its tokenizer and chat template are in its metadata). The store is
$OLLAMA_MODELS, else ~/.ollama/models, else /usr/share/ollama/.ollama/models (the Linux service's).

A name is read as Ollama reads it: `[host/][namespace/]model[:tag]`, the host registry.ollama.ai,
the namespace `library` and the tag `latest` where left out. Each part must be a plain name (letters,
digits, `.`, `_`, `-`), so no name reaches outside the store; the manifest is bounded, and a layer's
digest must be a SHA-256 in hex. A model whose manifest carries a LoRA adapter layer is refused, as
serving its base alone would answer otherwise; a vision projector layer is left unread (the model
is served for text). Its parameters layer (the sampling defaults and stop words its publisher set:
Qwen3's temperature 0.6, top_k 20, ...) is read by `parameters`; its Go template is not.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from neuron.errors import ConfigError

DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
PARAMS_LAYER = "application/vnd.ollama.image.params"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of layers: kilobytes
MAX_LISTED = 4096  # models listed from a store (`ollama list` of a large one holds dozens)
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


def store_dirs() -> list[Path]:
    """Where Ollama's store may be, in the order Ollama looks."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    try:
        home = [Path.home() / ".ollama" / "models"]
    except RuntimeError:  # no home directory (a service's user)
        home = []
    return [*home, Path("/usr/share/ollama/.ollama/models")]


def parse_name(name: str) -> tuple[str, str, str, str] | None:
    """(host, namespace, model, tag) of an Ollama model name; None for a string that is not one."""
    rest, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", DEFAULT_TAG)
    parts = rest.split("/")
    if not 1 <= len(parts) <= 3 or not all(_PART.fullmatch(p) for p in [*parts, tag]):  # no "..", no "/x"
        return None
    host, namespace = (DEFAULT_HOST, DEFAULT_NAMESPACE) if len(parts) == 1 else \
        (DEFAULT_HOST, parts[0]) if len(parts) == 2 else (parts[0], parts[1])
    return host, namespace, parts[-1], tag


def list_models(limit: int = MAX_LISTED) -> list[str]:
    """The models of Ollama's store by the names `ollama list` gives them (`qwen3:0.6b`,
    `namespace/model:tag`, `host/namespace/model:tag`), from the first store that has manifests;
    only plain names (parse_name's), at most `limit` of them, sorted."""
    for store in store_dirs():
        root = store / "manifests"
        if not root.is_dir():
            continue
        names = []
        for manifest in _manifests(root, limit):
            host, namespace, model, tag = manifest.relative_to(root).parts
            name = f"{model}:{tag}" if (host, namespace) == (DEFAULT_HOST, DEFAULT_NAMESPACE) else \
                f"{namespace}/{model}:{tag}" if host == DEFAULT_HOST else f"{host}/{namespace}/{model}:{tag}"
            if parse_name(name) == (host, namespace, model, tag):
                names.append(name)
        return sorted(names)
    return []


def _manifests(root: Path, limit: int) -> list[Path]:
    """Manifest files four levels under `root` (host, namespace, model, tag), each level a plain name
    and a real directory (no links out of the store); at most `limit`."""
    level = [root]
    for depth in range(4):
        found = []
        for folder in level:
            try:
                entries = sorted(folder.iterdir())
            except OSError:
                continue
            found += [entry for entry in entries if _PART.fullmatch(entry.name) and not entry.is_symlink()
                      and (entry.is_file() if depth == 3 else entry.is_dir())][:limit - len(found)]
            if len(found) >= limit:
                break
        level = found
    return level


def find_model(name: str) -> Path | None:
    """The GGUF blob of Ollama model `name` in the local store; None when the store has no such
    model (or `name` is not an Ollama name). ConfigError for a manifest that is malformed, names no
    weights or a missing blob, or carries an adapter."""
    found = _manifest(name)
    return None if found is None else _weights(*found, name)


def _manifest(name: str) -> tuple[Path, Path] | None:
    """(store, manifest file) of Ollama model `name`; None when no store has it."""
    parsed = parse_name(name)
    if parsed is None:
        return None
    host, namespace, model, tag = parsed
    for store in store_dirs():
        manifest = store / "manifests" / host / namespace / model / tag
        if manifest.is_file():
            return store, manifest
    return None


def parameters(name: str) -> dict | None:
    """The parameters layer of Ollama model `name` (a JSON object: `temperature`, `top_k`, `stop`,
    ...); None when `name` is no model of the store or has no such layer. ConfigError for one that
    is missing, too large or not a JSON object."""
    found = _manifest(name)
    if found is None:
        return None
    store, manifest = found
    layer = [layer for layer in _layers(manifest, name) if layer.get("mediaType") == PARAMS_LAYER]
    if not layer:
        return None
    params = _json(_blob(store, layer[0], name, "parameters"), f"Ollama model {name}: its parameters")
    if not isinstance(params, dict):
        raise ConfigError(f"Ollama model {name}: its parameters layer is not a JSON object")
    return params


def _json(path: Path, what: str):
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise ConfigError(f"{what}, {path}, is larger than such a file is")
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{what}, {path}, cannot be read: {exc}") from None


def _layers(manifest: Path, name: str) -> list[dict]:
    layers = _json(manifest, f"Ollama model {name}: its manifest")
    layers = layers.get("layers") if isinstance(layers, dict) else None
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise ConfigError(f"Ollama model {name}: its manifest {manifest} lists no layers")
    return layers


def _blob(store: Path, layer: dict, name: str, what: str) -> Path:
    """The blob file of a manifest's layer, its digest checked to be a SHA-256."""
    digest = layer.get("digest")
    match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is None:
        raise ConfigError(f"Ollama model {name}: its {what} layer's digest {digest!r:.80} is not a sha256 digest")
    for blob in (store / "blobs" / f"sha256-{match[1]}", store / "blobs" / f"sha256:{match[1]}"):
        if blob.is_file():
            return blob
    raise ConfigError(f"Ollama model {name}: its {what}, blob sha256-{match[1][:12]}..., are missing from "
                      f"{store / 'blobs'} (an interrupted pull: `ollama pull {name}` again)")


def _weights(store: Path, manifest: Path, name: str) -> Path:
    layers = _layers(manifest, name)
    kinds = [layer.get("mediaType") for layer in layers]
    if ADAPTER_LAYER in kinds:
        raise ConfigError(f"Ollama model {name} applies a LoRA adapter layer to its weights, which neuron does not "
                          "read from Ollama's store; serve the base model and the adapter (--lora-modules) instead")
    weights = [layer for layer in layers if layer.get("mediaType") == MODEL_LAYER]
    if len(weights) != 1:
        raise ConfigError(f"Ollama model {name}: its manifest {manifest} names {len(weights)} weight layers (one "
                          f"of {MODEL_LAYER} is served)")
    return _blob(store, weights[0], name, "weights")
