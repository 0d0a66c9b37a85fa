"""Classification and cross-encoder scoring on the leader: a linear head over the last token's
final-norm hidden state (an encoder's: a dense layer and its activation, then the head, over its
first token or, for ModernBERT where its config says so, the mean).

A sequence-classification checkpoint (`Qwen3ForSequenceClassification`, `LlamaForSequenceClassification`,
... in config.json's `architectures`) is the causal LM's body and a `score` matrix of one row per
label; transformers scores an input by that matrix times its last token's hidden state. A model
scored by its next-token logits for named tokens (Qwen3-Reranker: "yes" against "no") is served so
with `--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "is_original_qwen3_reranker": true}'`, as vLLM takes it: the head is those tokens'
rows of the LM head, and for two tokens read as a two-way softmax, their difference (one label whose
sigmoid is the second token's probability against the first).

The ranks pool the last token's hidden state as for a `lasttoken` embedding (models/pooling.py);
the leader multiplies it by the head (`Classifier.logits`), so no rank holds or runs the head.
A label's probability (`Classifier.probabilities`) is the sigmoid of a one-label head's logit and
the softmax of several, as vLLM's classify and score APIs return them. A pair of texts to score is
one input as vLLM makes it (`Classifier.sep`): a checkpoint's own head is a cross-encoder's, its
texts joined by the tokenizer's pair template; a head from named tokens is a language model's, its
texts joined as one text, as the model was prompted (config.json's `use_sep_token` says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from neuron.errors import ConfigError
from neuron.models import is_encoder

_SUFFIX = "ForSequenceClassification"
_TWO_WAY = "from_2_way_softmax"  # vLLM's `method` for a two-token head read as one label


@dataclass(frozen=True, eq=False, slots=True)
class Classifier:
    """A classification head: `weight` [labels, hidden] float32 (and `bias` [labels] or None), on
    the CPU; `labels` each row's name."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: tuple[str, ...]
    # how a pair of texts becomes one input (vLLM's `use_sep_token`): the tokenizer's pair template
    # (a cross-encoder's separator), or the two texts joined as one text (an LLM as a reranker)
    sep: bool = True
    # an encoder's layer before the head (BERT's pooler, RoBERTa's classifier.dense: tanh(W h + b);
    # DistilBERT's pre_classifier: relu(W h + b); ModernBERT's head: norm(gelu(W h)))
    dense: tuple[torch.Tensor, torch.Tensor | None] | None = None
    dense_activation: str = "tanh"  # tanh, relu or gelu
    dense_norm: tuple[torch.Tensor, torch.Tensor | None, float] | None = None  # a LayerNorm after it

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def logits(self, hidden: torch.Tensor) -> list[float]:
        """The head's logits for one pooled hidden state."""
        hidden = hidden.float().cpu()
        if self.dense is not None:
            weight, bias = self.dense
            hidden = weight @ hidden if bias is None else weight @ hidden + bias
            hidden = getattr(torch.nn.functional, self.dense_activation)(hidden)
            if self.dense_norm is not None:
                w, b, eps = self.dense_norm
                hidden = torch.nn.functional.layer_norm(hidden, w.shape, w, b, eps)
        out = self.weight @ hidden
        if self.bias is not None:
            out = out + self.bias
        return out.tolist()

    def probabilities(self, logits: list[float]) -> list[float]:
        """The labels' probabilities: a one-label head's sigmoid, several labels' softmax."""
        t = torch.tensor(logits, dtype=torch.float64)
        return (t.sigmoid() if len(logits) == 1 else t.softmax(-1)).tolist()


def is_classification(config: dict) -> bool:
    """Whether config.json (with --hf-overrides) names a sequence-classification architecture, or
    asks for a head from named tokens."""
    archs = config.get("architectures")
    named = isinstance(archs, list) and any(isinstance(a, str) and a.endswith(_SUFFIX) for a in archs)
    return named or config.get("classifier_from_token") is not None


def load_classifier(config: dict, weight_files: list[str], gguf: Path | None, tokenizer) -> Classifier:
    """The head of a classification model: rows of its LM head for `classifier_from_token` (a
    GGUF file's dequantized), else the checkpoint's `score.weight` (and `score.bias`). Refused,
    naming what is wrong, when the checkpoint has neither or they do not fit the model."""
    hidden = int(config.get("hidden_size") or 0)
    tokens = config.get("classifier_from_token")
    if gguf is not None:
        from neuron.models.gguf import GGUFReader

        reader = GGUFReader(gguf, config)  # rows of a quantized head, dequantized
    else:
        from neuron.models.loader import CheckpointReader

        reader = CheckpointReader(weight_files)
    try:
        if tokens is not None and is_encoder(config):
            raise ConfigError("classifier_from_token reads an LM head's rows, and an encoder has no LM head")
        if tokens is not None:
            return _from_tokens(config, reader, tokens, tokenizer, hidden)
        if is_encoder(config):
            return _encoder_head(config, reader, hidden, gguf is not None)
        if not reader.has("score.weight") and gguf is not None:
            raise ConfigError(f"{gguf.name}: a GGUF file without a classification head (cls.output); a reranker "
                              "scored by named tokens is served with classifier_from_token in --hf-overrides")
        if not reader.has("score.weight"):
            raise ConfigError("a classification model needs `score.weight` in its checkpoint (the head of a "
                              f"*{_SUFFIX} checkpoint), or `classifier_from_token` in --hf-overrides to score by "
                              "named tokens' logits")
        weight, bias = _labels_layer(reader, "score", hidden, bias=None)
        labels = _label_names(config, weight.shape[0])
        if gguf is None:
            return Classifier(weight, bias, labels, _sep(config, True))
        # llama.cpp's reranker head (Qwen3-Reranker's `yes` and `no` rows): a softmax over two rows scores
        # the first, which is the sigmoid of their difference; a pair is one prompt (its `rerank` template)
        if weight.shape[0] == 2:
            weight, bias, labels = weight[:1] - weight[1:], None if bias is None else bias[:1] - bias[1:], labels[:1]
        return Classifier(weight, bias, labels, False)
    finally:
        reader.close()


def _encoder_head(config: dict, reader, hidden: int, gguf: bool = False) -> Classifier:
    """An encoder's head over its first token: RoBERTa's classifier.dense then classifier.out_proj,
    or BERT's pooler.dense then classifier, each dense layer followed by tanh; DistilBERT's
    pre_classifier, ReLU, then classifier; ModernBERT's own (_modernbert_head). A GGUF file's
    (`gguf`): cls then cls.output, or cls.output alone where llama.cpp's converter left BERT's
    pooler out (llama.cpp scores such a file without it, and so does neuron)."""
    if config.get("model_type") == "modernbert":
        return _modernbert_head(config, reader, hidden)
    activation = "tanh"
    if reader.has("classifier.out_proj.weight"):
        dense, out = "classifier.dense", "classifier.out_proj"
    elif reader.has("pre_classifier.weight"):
        dense, out, activation = "pre_classifier", "classifier", "relu"
    else:
        pooler = next((f"{p}pooler.dense" for p in ("bert.", "") if reader.has(f"{p}pooler.dense.weight")), None)
        if pooler is None or not reader.has("classifier.weight"):
            raise ConfigError("an encoder's classification head needs classifier.weight and the pooler's "
                              "pooler.dense.weight (BERT), classifier.dense and classifier.out_proj (RoBERTa), "
                              "or pre_classifier and classifier (DistilBERT)")
        dense, out = pooler, "classifier"
    layer = None if gguf and not reader.has(f"{dense}.weight") else \
        (_shaped(reader, f"{dense}.weight", [hidden, hidden]), _shaped(reader, f"{dense}.bias", [hidden]))
    weight, bias = _labels_layer(reader, out, hidden, bias=None if gguf else True)
    return Classifier(weight, bias, _label_names(config, weight.shape[0]), _sep(config, True), layer, activation)


def _modernbert_head(config: dict, reader, hidden: int) -> Classifier:
    """ModernBERT's head: head.dense (a bias with classifier_bias), its classifier_activation (GELU),
    head.norm (a bias with norm_bias), then classifier."""
    act = config.get("classifier_activation", "gelu")
    if act not in ("gelu", "relu", "tanh"):
        raise ConfigError(f"classifier_activation {act!r} is not supported (gelu, relu and tanh are)")
    need = ["head.dense.weight", "head.norm.weight", "classifier.weight", "classifier.bias"]
    if config.get("classifier_bias"):
        need.append("head.dense.bias")
    if config.get("norm_bias"):
        need.append("head.norm.bias")
    missing = [name for name in need if not reader.has(name)]
    if missing:
        raise ConfigError(f"a ModernBERT classifier needs {', '.join(missing)} in its checkpoint")
    dense = _shaped(reader, "head.dense.weight", [hidden, hidden])
    dense_bias = _shaped(reader, "head.dense.bias", [hidden]) if config.get("classifier_bias") else None
    norm = (_shaped(reader, "head.norm.weight", [hidden]),
            _shaped(reader, "head.norm.bias", [hidden]) if config.get("norm_bias") else None,
            float(config.get("norm_eps", 1e-5)))
    weight, bias = _labels_layer(reader, "classifier", hidden, bias=True)
    return Classifier(weight, bias, _label_names(config, weight.shape[0]), _sep(config, True), (dense, dense_bias),
                      act, norm)


def _from_tokens(config: dict, reader, tokens, tokenizer, hidden: int) -> Classifier:
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ConfigError("classifier_from_token must be a non-empty list of token strings, such as [\"no\", \"yes\"]")
    if tokenizer is None:
        raise ConfigError("classifier_from_token needs the checkpoint's tokenizer to find its tokens")
    ids = []
    for token in tokens:
        id = tokenizer.token_to_id(token)
        if id is None:
            raise ConfigError(f"classifier_from_token: {token!r} is not a token of this vocabulary")
        ids.append(id)
    name = "lm_head.weight"
    if config.get("tie_word_embeddings") or not reader.has(name):
        name = "model.embed_tokens.weight"
    shape = reader.shape(name)
    if len(shape) != 2 or shape[1] != hidden:
        raise ConfigError(f"{name} has shape {shape}; expected [vocab, {hidden}]")
    if max(ids) >= shape[0]:
        raise ConfigError(f"classifier_from_token: token id {max(ids)} is past {name}'s {shape[0]} rows")
    rows = torch.stack([_float(reader, name, row) for row in ids])
    two_way = config.get("is_original_qwen3_reranker") is True or config.get("method") == _TWO_WAY
    if two_way:
        if len(ids) != 2:
            raise ConfigError(f"a two-way softmax head takes two tokens in classifier_from_token, got {len(ids)}")
        return Classifier(rows[1:] - rows[:1], None, (tokens[1],), _sep(config, False))
    return Classifier(rows, None, tuple(tokens), _sep(config, False))


def _sep(config: dict, default: bool) -> bool:
    """config.json's `use_sep_token` (or the older `use_pad_token`), else `default`: a checkpoint's
    own head is a cross-encoder's, with the pair template; a head from named tokens reads the two
    texts as one, as the language model was prompted."""
    for key in ("use_sep_token", "use_pad_token"):
        value = config.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
            return value
    return default


def _labels_layer(reader, prefix: str, hidden: int, bias: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A head's last layer: `prefix`.weight, one row per label over the hidden state, and its bias
    (`bias` None: where the checkpoint has one)."""
    weight = _float(reader, f"{prefix}.weight")
    if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] < 1:
        raise ConfigError(f"{prefix}.weight has shape {list(weight.shape)}; expected [num_labels, {hidden}]")
    if bias is None:
        bias = reader.has(f"{prefix}.bias")
    return weight, _shaped(reader, f"{prefix}.bias", [weight.shape[0]]) if bias else None


def _shaped(reader, name: str, shape: list[int]) -> torch.Tensor:
    """`_float`'s tensor, refused by name unless it has `shape`."""
    t = _float(reader, name)
    if list(t.shape) != shape:
        raise ConfigError(f"{name} has shape {list(t.shape)}; expected {shape}")
    return t


def _float(reader, name: str, row: int | None = None) -> torch.Tensor:
    """A floating-point tensor of the checkpoint (one row of it), as float32."""
    t = reader.read(name) if row is None else reader.read(name, 0, row, row + 1)[0]
    if not t.is_floating_point():
        raise ConfigError(f"{name} is stored as {t.dtype}: a classification head is read from a floating-point "
                          "tensor (a quantized head is not supported)")
    return t.float().contiguous()


def _label_names(config: dict, n: int) -> tuple[str, ...]:
    """config.json's `id2label` names when they cover every row, else LABEL_0, LABEL_1, ..."""
    names = config.get("id2label")
    if isinstance(names, dict):
        try:
            by_index = {int(k): str(v) for k, v in names.items()}
        except (TypeError, ValueError):
            by_index = {}
        if sorted(by_index) == list(range(n)):
            return tuple(by_index[i] for i in range(n))
    return tuple(f"LABEL_{i}" for i in range(n))
