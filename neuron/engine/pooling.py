"""Embeddings on the leader: what a model is served for, how it pools, and the vectors it returns.

A pooling model (Qwen3-Embedding, any sentence-transformers checkpoint of a decoder neuron runs) is
a causal LM whose final-norm hidden states are pooled into one vector per input: the last token's
(`lasttoken`), their mean (`mean`) or the first token's (`cls`), L2-normalized when the checkpoint
has a Normalize module. sentence-transformers describes this in `modules.json` and
`1_Pooling/config.json`; `--task embed` on a checkpoint without them pools the last token and
normalizes, as Qwen3-Embedding does.

A pooling request runs through the scheduler like any other, prefill only: each of its chunks
asks rank 0 for what the mode needs of it (`SeqStep.pool`), and `Pooled` adds the chunks up until
the prompt is done. Nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from neuron.errors import ConfigError

GENERATE, EMBED = "generate", "embed"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# sentence-transformers' pooling flags, as neuron's modes
_MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How a model's hidden states become one embedding."""

    mode: str = "lasttoken"  # lasttoken, mean or cls
    normalize: bool = True  # L2-normalize the pooled vector (and again after `dimensions` truncates it)

    def chunk_op(self, offset: int, length: int, prompt_len: int) -> str | None:
        """What rank 0 returns for a prompt chunk [offset, offset + length) (`SeqStep.pool`):
        `last` (its last row), `first` (its first row) or `sum` (of its rows); None when the
        chunk holds nothing the mode needs."""
        if self.mode == "mean":
            return "sum"
        if self.mode == "cls":
            return "first" if offset == 0 else None
        return "last" if offset + length == prompt_len else None


def resolve_tasks(task: str, model_dir: Path, read_json) -> tuple[frozenset[str], PoolingConfig | None]:
    """What the model serves (`task`: auto, generate, embed or generate,embed) and, when it embeds,
    how it pools: from the checkpoint's sentence-transformers files, else the last token,
    normalized. `auto` embeds only when those files say the checkpoint is a pooling model."""
    found = sentence_transformers_pooling(model_dir, read_json)
    if task == "auto":
        task = EMBED if found is not None else GENERATE
    tasks = frozenset(task.split(","))
    if EMBED not in tasks:
        return tasks, None
    return tasks, found or PoolingConfig()


def sentence_transformers_pooling(model_dir: Path, read_json) -> PoolingConfig | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json: a Transformer, a
    Pooling module, optionally Normalize); None when it has no modules.json or no Pooling module.
    What neuron cannot reproduce (another pooling mode, a Dense layer) is refused, naming it."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{path}: expected a list of modules, each an object with `type` and `path`")
    types = [str(m.get("type", "")) for m in modules]
    if _ST_POOLING not in types:
        return None
    others = [t for t in types if t not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if others:
        raise ConfigError(f"{path}: module {others[0]!r} is not supported (neuron pools the hidden states and "
                          "normalizes them: Transformer, Pooling and Normalize modules only)")
    folder = str(modules[types.index(_ST_POOLING)].get("path") or "1_Pooling")
    pooling = model_dir / folder / "config.json"
    if not pooling.resolve().is_relative_to(model_dir.resolve()):
        raise ConfigError(f"{path}: the Pooling module's path {folder!r} leads out of the checkpoint")
    cfg = read_json(pooling)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{pooling}: expected an object of pooling_mode_* flags")
    unsupported = [k for k in _UNSUPPORTED if cfg.get(k)]
    if unsupported:
        raise ConfigError(f"{pooling}: {unsupported[0]} is not supported (lasttoken, mean and cls pooling are)")
    if cfg.get("include_prompt") is False:
        raise ConfigError(f"{pooling}: include_prompt false is not supported (every token is pooled)")
    modes = [mode for key, mode in _MODES.items() if cfg.get(key)]
    if len(modes) != 1:
        raise ConfigError(f"{pooling}: exactly one of {', '.join(_MODES)} must be true, found "
                          f"{len(modes)}")
    return PoolingConfig(modes[0], _ST_NORMALIZE in types)


@dataclass(slots=True)
class Pooled:
    """A pooling sequence's vector so far: the chunks' contributions, on the leader's CPU."""

    total: torch.Tensor | None = None
    rows: int = 0

    def add(self, op: str, value: torch.Tensor, length: int) -> None:
        value = value.float().cpu()
        if op == "sum":
            self.total = value if self.total is None else self.total + value
            self.rows += length
        else:
            self.total, self.rows = value, 1

    def reset(self) -> None:
        """The sequence starts over (preempted, to be recomputed from its first token)."""
        self.total, self.rows = None, 0

    def vector(self, cfg: PoolingConfig) -> list[float]:
        v = self.total / max(self.rows, 1) if cfg.mode == "mean" else self.total
        return finish(v, cfg.normalize)


def finish(v: torch.Tensor, normalize: bool, dimensions: int | None = None) -> list[float]:
    """The embedding as a client gets it: its first `dimensions` values (Matryoshka truncation),
    L2-normalized after the cut when the model normalizes."""
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.tolist()


def wanted(s) -> str | None:
    """What rank 0 returns for this scheduled chunk of a pooling request (`SeqStep.pool`); None
    for any other request, or a chunk that holds nothing its pooling needs."""
    seq = s.seq
    if seq.pooling is None:
        return None
    return seq.pooling.chunk_op(s.offset, len(s.token_ids), len(seq.prompt_token_ids))


def accumulate(part: list, steps: list, result) -> None:
    """Add this step's pooled rows (rank 0's `StepResult.pooled`) to each pooling request of `part`.
    A chunk at offset 0 starts the vector anew: a preempted request is recomputed from its start."""
    for i, (s, step) in enumerate(zip(part, steps)):
        if step.pool is None or i not in result.pooled:
            continue
        if s.offset == 0:
            s.seq.pooled.reset()
        s.seq.pooled.add(step.pool, result.pooled[i], len(s.token_ids))
