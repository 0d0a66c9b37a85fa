"""A model as one engine runs it, resolved once from the user's arguments and the model's files.

`resolve_model_config(spec)` is the one place that reads a checkpoint's description: config.json
or a GGUF file's metadata (with `--hf-overrides` merged in), its `quantization_config`,
generation_config.json and preprocessor_config.json. It checks every field before anything is
sized from it (models/config_check.py), refuses a tensor-parallel size the model does not split
into, and works out what the rest of neuron runs by: the model length, the tokenizer and its stop
ids, the vision spec, speculative decoding, the step's token budget, the KV cache budget.

The result is frozen and whole. The engine reads it; the executor's config, every rank's load
message (`ShardSpec`) and a draft model's configuration are derived from it by the methods below,
so a field added here reaches every rank without being copied by hand. Nothing in it is kept at
module level: an engine per model in one process resolves a configuration each.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from neuron.config import MAX_MODEL_LEN_CAP, parse_bytes
from neuron.engine.classifier import is_classification, load_classifier
from neuron.engine.engine_config import EngineConfig, default_device
from neuron.engine.gguf_vocab import GGUFVocabulary
from neuron.engine.pooling import CLASSIFY, EMBED, GENERATE, PoolingConfig
from neuron.engine.sampling_params import REPETITION_PENALTY_RANGE
from neuron.engine.spec_decode.config import SpeculativeConfig
from neuron.engine.tokenizer import Tokenizer, TokenizerError
from neuron.errors import ConfigError
from neuron.executor.executor import ExecutorConfig
from neuron.models import (
    DENSE_MODEL_TYPES,
    MULTIMODAL_MODEL_TYPES,
    check_supported,
    check_tp,
    context_length,
    is_encoder,
    merged,
    parse_config,
    standard_config,
    supports_prefix_caching,
    text_config,
)
from neuron.models.bert import token_types
from neuron.models.config_check import Fields, check_config
from neuron.models.gguf import ARCHITECTURES, GGUFFile, find_gguf, open_file
from neuron.models.loader import CheckpointReader, read_json, resolve_model_path, safetensors_files, weight_files
from neuron.models.quant_formats import stored_format
from neuron.multimodal.image import VisionSpec
from neuron.rpc.protocol import ShardSpec
from neuron.step import VerifyShape
from neuron.worker.failure import resolve_dtype, resolve_kv_dtype


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model, resolved: what every part of neuron that runs it reads."""

    spec: EngineConfig  # the user's arguments it was resolved from
    name: str  # what clients call it (served_model_name, else the model as given)
    model_dir: Path
    weight_files: tuple[str, ...]
    hf_config: dict  # config.json (or GGUF metadata) with the overrides merged in, checked
    gguf: Path | None
    device: str
    stored_format: dict | None  # the checkpoint's own quantized format (quant_formats), None: dense
    quantization: str | None  # how the weights are held when quantized, for logs and /health
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer | None
    generation_config: dict
    sampling: dict  # generation_config.json's sampling defaults, checked at load (sampling_defaults)
    eos_token_ids: tuple[int, ...]
    vision: VisionSpec | None
    speculative: SpeculativeConfig | None
    prefix_caching: bool
    step_tokens: int  # the token budget of one step
    kv_cache_bytes: int  # per rank; 0: sized by the rank (free GPU memory, or room for max_num_seqs on CPU)
    tasks: frozenset[str] = frozenset({"generate"})  # what it serves: "generate", "embed" (engine/pooling.py)
    pooling: PoolingConfig | None = None  # how it embeds, when "embed" is one of its tasks

    @property
    def model_type(self) -> str:
        return self.hf_config["model_type"]

    def default_sampling(self) -> dict:
        """Sampling defaults from generation_config.json, applied where a request is silent (as
        SamplingParams' fields: its max_new_tokens is max_tokens)."""
        return dict(self.sampling)

    @property
    def encoder(self) -> bool:
        """Whether it is an encoder (models/bert.py): each input whole in one step, nothing generated."""
        return is_encoder(self.hf_config)

    @property
    def token_types(self) -> int:
        """How many token types an encoder embeds (a pair's second text is type 1 where it has two);
        0 for any other model."""
        return token_types(self.hf_config) if self.encoder else 0

    @property
    def classifier(self):
        """A classification model's head (engine/classifier.py); None for any other model."""
        return None if self.pooling is None else self.pooling.classifier

    @property
    def hidden_size(self) -> int:
        """The width of its hidden states: an embedding's length."""
        return int(text_config(self.hf_config)["hidden_size"])

    @property
    def verify(self) -> VerifyShape:
        """The shape of speculative decoding's verifying steps (none without it)."""
        return self.speculative.verify_shape if self.speculative is not None else VerifyShape()

    def shard_spec(self) -> ShardSpec:
        """What every rank loads: its share of these weights, and a KV pool for these sequences."""
        s = self.spec
        return ShardSpec(config_json=json.dumps(self.hf_config), weight_paths=list(self.weight_files), dtype=s.dtype,
                         quantization=s.quantization or "", stored_format=self.stored_format,
                         vision=asdict(self.vision) if self.vision is not None else None, max_slots=s.max_num_seqs,
                         max_model_len=self.max_model_len, block_size=s.block_size,
                         kv_cache_bytes=self.kv_cache_bytes, gpu_memory_utilization=s.gpu_memory_utilization,
                         max_num_batched_tokens=max(self.step_tokens, s.max_num_seqs), verify=self.verify,
                         max_loras=s.max_loras if s.enable_lora else 0,
                         max_lora_rank=s.max_lora_rank if s.enable_lora else 0,
                         kv_cache_dtype="" if s.kv_cache_dtype == "auto" else s.kv_cache_dtype, **self._draft_room())

    def _draft_room(self) -> dict[str, int]:
        """What rank 0's pool leaves free on its GPU for speculative decoding's draft, which loads
        there after it (spec_decode/draft.py): a block of its own for each of the pool's (bytes per
        block), and its weights plus a bound on what its steps and decode graphs keep (the rows of
        its largest batch, and their logits). Nothing on CPU, or with an explicit KV budget."""
        if self.speculative is None or self.speculative.model is None or not self.device.startswith("cuda") \
                or self.kv_cache_bytes:
            return {}
        import torch

        from neuron.models.memory_plan import kv_bytes_per_token, weight_bytes
        from neuron.worker.failure import resolve_dtype

        draft, s = resolve_model_config(self.draft_spec()), self.spec
        t = text_config(draft.hf_config)
        size = torch.finfo(resolve_dtype(s.dtype, self.device)).bits // 8
        rows = max(s.max_num_seqs, draft.step_tokens)
        steps = 2 * rows * (4 * int(t["hidden_size"]) + 3 * int(t.get("intermediate_size") or 0)) * size \
            + 3 * s.max_num_seqs * draft.vocab_size * 4 + 256 * 2**20
        return {"draft_block_bytes": kv_bytes_per_token(draft.hf_config, 1, size) * s.block_size,
                "draft_bytes": weight_bytes([Path(f) for f in draft.weight_files], size) + steps}

    def executor_config(self, model_id: str = "model") -> ExecutorConfig:
        """How the executor brings these ranks up: where (the spec's placement), and what they load."""
        s = self.spec
        return ExecutorConfig(self.model_dir, shard=self.shard_spec(), tp=s.tp, hosts=s.hosts,
                              worker_launcher=s.worker_launcher, cluster_address=s.cluster_address,
                              cluster_interface=s.cluster_interface, cluster_port=s.cluster_port, device=self.device,
                              devices=tuple(s.devices) if s.devices else None, model_id=model_id, name=self.name,
                              load_timeout_s=s.load_timeout_s)

    def draft_spec(self) -> EngineConfig:
        """The arguments of speculative decoding's draft model: one rank on rank 0's device, this
        model's dtype, slots, blocks and step budget, no speculation of its own (its length is the
        target's: spec_decode/draft.py)."""
        assert self.speculative is not None and self.speculative.model is not None
        return replace(self.spec, model=self.speculative.model, tp=1, hosts=None, device=self.device,
                       devices=self.spec.devices[:1] if self.spec.devices else None,
                       quantization=None, speculative_config=None, hf_overrides=None, tokenizer=None,
                       served_model_name=None, kv_cache_memory=None, kv_cache_dtype="auto", max_model_len=None,
                       max_num_batched_tokens=self.step_tokens)


def resolve_model_config(spec: EngineConfig, phases: Callable[[str], None] = lambda what: None) -> ModelConfig:
    """The model `spec` names, read and checked (ConfigError saying what to change, before any
    worker starts). `phases(what)` hears which part it is reading, for the load's deadline."""
    phases("finding the model")
    if spec.model is None:
        from neuron.utils.default_checkpoint import default_model_dir

        model_dir = default_model_dir()
    else:
        model_dir = resolve_model_path(spec.model, spec.hf_cache_dir)
    phases(f"reading the config of {model_dir}")
    gguf = find_gguf(model_dir)
    config = load_config(model_dir, spec.hf_overrides)
    check_tp(config, spec.tp)
    stored = stored_format(config.get("quantization_config") or text_config(config).get("quantization_config"))
    vocab = text_config(config)["vocab_size"]
    phases("building the tokenizer")
    tokenizer, tokenizer_dir = _tokenizer(spec, model_dir, gguf)
    sentence_bert = SentenceBertConfig.read(model_dir)
    if tokenizer is not None:
        tokenizer.lowercase = sentence_bert.do_lower_case
        tokenizer.typed_pairs = _typed_pairs(config, tokenizer)
    generation, where = _generation_config(tokenizer_dir), "generation_config.json"
    if not generation and gguf is not None and spec.tokenizer is None and spec.model is not None:
        generation, where = _ollama_generation(spec.model, gguf, config, tokenizer), "the Ollama model's parameters"
    sampling = _check_generation(generation, vocab, where)
    speculative = _speculative(spec, config)
    _check_lora(spec, config)
    phases("reading what the model is served for")
    files = weight_files(model_dir)
    tasks, pooling = _tasks(spec.task, model_dir, config, files, gguf, tokenizer)
    if GENERATE in tasks and gguf is None:
        _check_lm_head(config, files)
    device = (spec.devices[0].split(":")[0] if spec.devices else None) or spec.device or default_device()
    check_kv_cache_dtype(spec.kv_cache_dtype, spec.dtype, device)
    max_model_len = _max_model_len(spec, config, sentence_bert.max_seq_length)
    step_tokens = spec.max_num_batched_tokens or max(spec.prefill_chunk_tokens, spec.max_num_seqs)
    if is_encoder(config):  # an input runs whole in one step
        step_tokens = max(step_tokens, max_model_len)
    return ModelConfig(
        spec=spec, name=spec.served_model_name or spec.model or "neuron-default", model_dir=model_dir,
        weight_files=tuple(str(f) for f in files), hf_config=config, gguf=gguf,
        device=device,
        stored_format=stored,
        quantization=spec.quantization or _stored_label(gguf, stored),
        max_model_len=max_model_len, vocab_size=vocab, tokenizer=tokenizer,
        generation_config=generation, sampling=sampling, eos_token_ids=_eos_ids(config, generation, tokenizer),
        vision=_vision(config, model_dir), speculative=speculative, prefix_caching=_prefix_caching(spec, config),
        step_tokens=step_tokens,
        kv_cache_bytes=0 if spec.kv_cache_memory is None else parse_bytes(spec.kv_cache_memory, "kv_cache_memory"),
        tasks=tasks, pooling=pooling)


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device: str) -> None:
    """Refuse a KV cache type the device's attention kernel does not read: on CUDA the kernels read
    the model dtype; on CPU the kernel reads the model dtype, and 16-bit keys and values under an
    fp32 model's queries (a cache of another type would leave every step on the slow reference)."""
    kv, model = resolve_kv_dtype(kv_cache_dtype, dtype, device), resolve_dtype(dtype, device)
    name = str(model).removeprefix("torch.")
    if device.startswith("cuda") and kv != model:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {name}: on CUDA the KV "
                          "cache holds the model dtype (kv_cache_dtype auto); a 16-bit cache for an fp32 model is "
                          "for CPUs")
    if kv != model and name != "float32":
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype} with the model dtype {name}: a KV cache holds the model "
                          "dtype (kv_cache_dtype auto), or, for an fp32 model, float16 or bfloat16")


def load_config(model_dir: Path, overrides: dict | None = None) -> dict:
    """A checkpoint's config.json (or GGUF metadata) with `overrides` merged in (nested objects key
    by key), refused at once when neuron cannot run its architecture or a field is out of range."""
    gguf = find_gguf(model_dir)
    where = str(gguf) if gguf is not None else str(model_dir / "config.json")
    base = _gguf_config(open_file(gguf)) if gguf is not None else read_json(model_dir / "config.json")
    Fields(base, where)  # an object, not a list or a number
    if overrides:
        where += " with --hf-overrides"
    config = standard_config(merged(base, overrides or {}))
    check_supported(config)
    try:
        check_config(config, where)
    except ConfigError as exc:
        field = getattr(exc, "field", "")
        key = _METADATA_KEYS.get(field) if gguf is not None else None
        if key is None or (overrides and field in overrides):
            raise
        raise ConfigError(f"{exc} (GGUF metadata {open_file(gguf).field('general.architecture')}.{key})") from None
    stored_format(config.get("quantization_config") or text_config(config).get("quantization_config"))
    parse_config(config)  # what the ranks' parser refuses, refused here first
    return config


# ---- a GGUF file's metadata as config.json --------------------------------------------------------

# config.json's fields as GGUF metadata names them (under the architecture's prefix), for messages
_METADATA_KEYS = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
                  "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
                  "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
                  "max_position_embeddings": "context_length", "rope_theta": "rope.freq_base",
                  "intermediate_size": "feed_forward_length", "vocab_size": "vocab_size",
                  "num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
                  "moe_intermediate_size": "expert_feed_forward_length",
                  "layer_norm_eps": "attention.layer_norm_epsilon"}
_HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                     "qwen2": "Qwen2ForCausalLM", "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                     "bert": "BertModel"}


def _gguf_config(f: GGUFFile) -> dict:
    """A GGUF file's hyper-parameters as a transformers config.json would hold them. Their ranges
    are checked with any other config's (config_check), under transformers' names."""
    arch = f.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{f.path.name}: GGUF architecture {arch!r} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    f.check_types()

    def number(key: str, default=None, kind: type = int):
        value = f.field(f"{arch}.{key}", default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ConfigError(f"{f.path.name}: GGUF metadata {arch}.{key} must be "
                              f"{'an integer' if kind is int else 'a number'}, got {str(value)[:80]!r}")
        return kind(value)

    missing = [key for key in ("block_count", "embedding_length", "attention.head_count")
               if f.field(f"{arch}.{key}") is None]
    if missing:
        raise ConfigError(f"{f.path.name}: GGUF metadata lacks {', '.join(arch + '.' + k for k in missing)}")
    hidden, heads = number("embedding_length"), number("attention.head_count")
    embed = f.tensors.get("token_embd.weight")
    vocab = number("vocab_size") or f.count("tokenizer.ggml.tokens") or (int(embed.shape[1]) if embed is not None
                                                                         else None)
    if arch == "bert":
        return _gguf_bert_config(f, number, vocab)
    config = {
        "model_type": ARCHITECTURES[arch], "architectures": [_HF_ARCHITECTURES[arch]],
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": number("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": number("attention.head_count_kv", heads),
        "head_dim": number("attention.key_length", hidden // heads if heads else None),  # 0 heads: refused later
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6, float),
        "max_position_embeddings": number("context_length", 4096),
        "rope_theta": number("rope.freq_base", 10000.0, float),
        "tie_word_embeddings": "output.weight" not in f.tensors, "hidden_act": "silu", "torch_dtype": "float32",
    }
    if (ff := number("feed_forward_length")) is not None:
        config["intermediate_size"] = ff
    if (labels := _gguf_labels(f, arch)) is not None:  # a reranker (llama.cpp's Qwen3-Reranker: yes, no)
        config.update(architectures=[_HF_ARCHITECTURES[arch].replace("ForCausalLM", "ForSequenceClassification")],
                      id2label=labels)
    if arch == "qwen3moe":
        config.update(num_experts=number("expert_count"), num_experts_per_tok=number("expert_used_count"),
                      moe_intermediate_size=number("expert_feed_forward_length"),
                      # llama.cpp normalises Qwen3-MoE's top-k weights unless the file says otherwise
                      norm_topk_prob=bool(f.field(f"{arch}.expert_weights_norm", True)))
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    if arch in ("qwen35", "qwen35moe"):
        config.update(_gguf_qwen35(f, arch, number, config))
    scaling = f.field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling, "factor": number("rope.scaling.factor", 1.0, float),
            "original_max_position_embeddings": number("rope.scaling.original_context_length",
                                                       config["max_position_embeddings"])}
    if (bos := f.field("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = bos  # an integer in range, or refused by the config check
    # llama.cpp ends a generation at any of the file's end-of-generation tokens: its EOS, EOT and EOM
    # (Llama 3's <|end_of_text|>, <|eot_id|> and <|eom_id|>), each refused by the config check if out of range
    ends = [v for key in ("eos", "eot", "eom") if (v := f.field(f"tokenizer.ggml.{key}_token_id")) is not None]
    if ends:
        config["eos_token_id"] = ends[0] if len(ends) == 1 else list(dict.fromkeys(ends))
    return config


def _gguf_bert_config(f: GGUFFile, number: Callable, vocab: int | None) -> dict:
    """llama.cpp's `bert` architecture as BERT's config.json: a bidirectional encoder of learned
    positions and token types, post-norm layers with biases and GELU. With a `t5` (sentencepiece
    unigram) vocabulary it is XLM-RoBERTa (bge-m3, multilingual-e5): positions counted past the
    padding id, whose rows before it llama.cpp's converter cut from the table and from the context
    length (the reader puts them back, models/gguf.py). RoBERTa's (a `gpt2` vocabulary) is refused by
    name."""
    vocabulary = f.field("tokenizer.ggml.model")
    if vocabulary not in (None, "", "none", "no_vocab", "bert", "t5"):
        raise ConfigError(f"{f.path.name}: a GGUF `bert` file with a {vocabulary!r} vocabulary (RoBERTa's) is not "
                          "read; serve the checkpoint's safetensors")
    if f.field("bert.attention.causal", False) is not False:
        raise ConfigError(f"{f.path.name}: GGUF metadata bert.attention.causal must be false: BERT attends both ways")
    types = f.tensors.get("token_types.weight")
    config = {
        "model_type": "bert", "architectures": ["BertModel"], "vocab_size": vocab,
        "hidden_size": number("embedding_length"), "num_hidden_layers": number("block_count"),
        "num_attention_heads": number("attention.head_count"), "intermediate_size": number("feed_forward_length"),
        "layer_norm_eps": number("attention.layer_norm_epsilon", 1e-12, float),
        "max_position_embeddings": number("context_length", 512), "hidden_act": "gelu", "torch_dtype": "float32",
        # the table's rows where the file has one (the count in the metadata is only a check of it)
        "type_vocab_size": int(types.shape[1]) if types is not None and len(types.shape) == 2 else
        f.field("tokenizer.ggml.token_type_count", 2),
    }
    if (pad := f.field("tokenizer.ggml.padding_token_id")) is not None:
        config["pad_token_id"] = pad  # an integer in range, or refused by the config check
    if vocabulary == "t5":
        if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < (vocab or 0):
            raise ConfigError(f"{f.path.name}: an XLM-RoBERTa GGUF file needs tokenizer.ggml.padding_token_id, past "
                              f"which its positions count (got {pad!r:.40})")
        config.update(model_type="xlm-roberta", architectures=["XLMRobertaModel"],
                      max_position_embeddings=config["max_position_embeddings"] + pad + 1)
    if (labels := _gguf_labels(f, "bert")) is not None:  # a cross-encoder (bge-reranker-v2-m3)
        config.update(architectures=["XLMRobertaForSequenceClassification" if vocabulary == "t5" else
                                     "BertForSequenceClassification"], id2label=labels)
    return config


def _gguf_qwen35(f: GGUFFile, arch: str, number: Callable, config: dict) -> dict:
    """Qwen3.5's text model as llama.cpp's `qwen35` and `qwen35moe` describe it: its linear
    attention's heads (the value heads' width given whole), which layers are linear (or every
    fourth one full), an interleaved multimodal rotary embedding over part of each head, a
    multi-token-prediction block counted among the layers, which neuron leaves out, and the MoE's
    routed and shared experts."""
    missing = [key for key in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
                               "ssm.inner_size", "rope.dimension_count") if number(key) is None]
    if missing:
        raise ConfigError(f"{f.path.name}: GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    value_heads, head_dim = number("ssm.time_step_rank"), config["head_dim"]
    inner, rotary = number("ssm.inner_size"), number("rope.dimension_count")
    if not value_heads or not inner or inner % value_heads or not head_dim or not rotary:
        raise ConfigError(f"{f.path.name}: GGUF metadata {arch}.ssm.time_step_rank, ssm.inner_size (a multiple of "
                          "it) and rope.dimension_count must be positive")
    layers = config["num_hidden_layers"] - (number("nextn_predict_layers", 0) or 0)
    sections = f.array(f"{arch}.rope.dimension_sections") or []
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= head_dim for x in sections):
        raise ConfigError(f"{f.path.name}: GGUF metadata {arch}.rope.dimension_sections must be counts of rotary "
                          "dimensions")
    out = {"model_type": ARCHITECTURES[arch], "num_hidden_layers": layers,
           "linear_conv_kernel_dim": number("ssm.conv_kernel"), "linear_key_head_dim": number("ssm.state_size"),
           "linear_num_key_heads": number("ssm.group_count"), "linear_num_value_heads": value_heads,
           "linear_value_head_dim": inner // value_heads,
           "full_attention_interval": number("full_attention_interval", 4),
           "rope_parameters": {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                               "partial_rotary_factor": rotary / head_dim, "mrope_interleaved": True,
                               "mrope_section": [x for x in sections if x] or [11, 11, 10]}}
    recurrent = f.array(f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        if not all(isinstance(x, bool) for x in recurrent) or len(recurrent) < layers:
            raise ConfigError(f"{f.path.name}: GGUF metadata {arch}.attention.recurrent_layers must give each of the "
                              f"{layers} layers true or false")
        out["layer_types"] = ["linear_attention" if x else "full_attention" for x in recurrent[:layers]]
    if arch == "qwen35moe":  # routed experts beside a shared one, whose width is the dense MLP's
        out.update(num_experts=number("expert_count"), num_experts_per_tok=number("expert_used_count"),
                   moe_intermediate_size=number("expert_feed_forward_length"),
                   shared_expert_intermediate_size=number("expert_shared_feed_forward_length"))
    return out


def _gguf_labels(f: GGUFFile, arch: str) -> dict | None:
    """A classification head's labels (llama.cpp's `cls.output` tensor, one row a label), named by
    `{arch}.classifier.output_labels` (or LABEL_0, ...), as config.json's id2label; None without a
    head."""
    head = f.tensors.get("cls.output.weight")
    if head is None:
        return None
    rows = int(head.shape[1]) if len(head.shape) == 2 else 0
    labels = f.array(f"{arch}.classifier.output_labels")
    if labels is not None and (len(labels) != rows or not all(isinstance(x, str) for x in labels)):
        raise ConfigError(f"{f.path.name}: GGUF metadata {arch}.classifier.output_labels must name each of the "
                          f"{rows} rows of cls.output.weight")
    return {str(i): x for i, x in enumerate(labels or [f"LABEL_{i}" for i in range(rows)])}


# ---- the rest of the model's description ---------------------------------------------------------


def _tokenizer(spec: EngineConfig, model_dir: Path, gguf: Path | None) -> tuple[Tokenizer | None, Path | None]:
    """The tokenizer (--tokenizer's, else the checkpoint's own or the GGUF file's; None without
    one) and the folder whose generation_config.json applies."""
    folder = resolve_model_path(spec.tokenizer, spec.hf_cache_dir) if spec.tokenizer else None
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"--tokenizer {spec.tokenizer}: pass a folder (or cached repo) holding tokenizer.json")
    if folder is None and gguf is not None:
        # a GGUF file may carry no tokenizer (then prompts are token ids): no tokenizer.ggml.model, or
        # the "none" llama.cpp's converter writes for a checkpoint without one
        f = open_file(gguf)
        model = f.field("tokenizer.ggml.model")
        # an encoder's vocabulary (BERT's WordPiece, XLM-RoBERTa's unigram in a `bert` file) is rebuilt
        # by neuron, any other by transformers' GGUF converter
        arch = f.field("general.architecture")
        encoder = model == "bert" or (model == "t5" and arch == "bert")
        tokenizer = None if model in (None, "", "none", "no_vocab") else \
            Tokenizer.from_vocabulary(_gguf_vocabulary(f, model), gguf.name) if encoder else \
            Tokenizer.from_gguf(gguf, ARCHITECTURES.get(arch, arch))
        if tokenizer is not None and (rerank := f.field("tokenizer.chat_template.rerank")) is not None:
            if not isinstance(rerank, str) or "{query}" not in rerank or "{document}" not in rerank:
                raise ConfigError(f"{gguf.name}: GGUF metadata tokenizer.chat_template.rerank must be a text holding "
                                  "{query} and {document}")
            tokenizer.pair_format = rerank
        return _with_chat_template(tokenizer, spec.chat_template), None
    folder = folder or model_dir
    tokenizer = Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None
    return _with_chat_template(tokenizer, spec.chat_template), folder


# each special token's metadata keys, the first a file has: llama.cpp's converter writes BERT's [CLS]
# as the BOS token and [SEP] as the separator and the EOS token
_VOCABULARY_IDS = {"cls_token": ("tokenizer.ggml.cls_token_id", "tokenizer.ggml.bos_token_id"),
                   "sep_token": ("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id"),
                   "unk_token": ("tokenizer.ggml.unknown_token_id",), "pad_token": ("tokenizer.ggml.padding_token_id",),
                   "mask_token": ("tokenizer.ggml.mask_token_id",), "bos_token": ("tokenizer.ggml.bos_token_id",),
                   "eos_token": ("tokenizer.ggml.eos_token_id",)}


def _gguf_vocabulary(f: GGUFFile, model: str) -> GGUFVocabulary:
    """A GGUF file's BERT WordPiece or XLM-RoBERTa unigram vocabulary (engine/gguf_vocab.py) as its
    metadata holds it; lowercasing (and stripping accents, unless the file says otherwise) where it
    does not say, and a space before the text, as llama.cpp reads it."""
    ids = {}
    for name, keys in _VOCABULARY_IDS.items():
        if (key := next((k for k in keys if f.field(k) is not None), None)) is not None:
            ids[name] = (key, f.field(key))
    return GGUFVocabulary(model, f.array("tokenizer.ggml.tokens") or [], f.array("tokenizer.ggml.token_type") or [],
                          ids, f.field("tokenizer.ggml.normalizer.lowercase", True),
                          f.field("tokenizer.ggml.normalizer.strip_accents"), f.array("tokenizer.ggml.scores"),
                          f.array("tokenizer.ggml.precompiled_charsmap"),
                          f.field("tokenizer.ggml.add_space_prefix", True))


def _with_chat_template(tokenizer: Tokenizer | None, given: str | None) -> Tokenizer | None:
    """The tokenizer with --chat-template in place of its own templates: a file's text, or the
    template itself (Jinja has `{{` or `{%`), compiled now so that a broken one stops the load."""
    if given is None or tokenizer is None:
        if given is not None:
            raise ConfigError("--chat-template needs the model's tokenizer (tokenizer.json, or a GGUF file's)")
        return tokenizer
    path = Path(given).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in given or "{%" in given:
        text = given
    else:
        raise ConfigError(f"--chat-template {given!r}: no such file, and not a Jinja template")
    try:
        tokenizer.use_chat_template(text)
    except TokenizerError as exc:
        raise ConfigError(f"--chat-template: {exc}") from None
    return tokenizer


def _generation_config(folder: Path | None) -> dict:
    path = folder / "generation_config.json" if folder is not None else None
    return read_json(path) if path is not None and path.is_file() else {}


def sampling_defaults(generation: dict, where: str = "generation_config.json") -> dict:
    """generation_config.json's sampling fields, as vLLM applies them, named as SamplingParams'
    (max_new_tokens is max_tokens; null ones left out). ConfigError for a value of the wrong type
    or out of range, which every request would otherwise meet."""
    f = Fields(generation, where)
    lo, hi = REPETITION_PENALTY_RANGE
    values = {"temperature": f.float("temperature", 0, 1e6), "top_p": f.float("top_p", 0, 1, above=True),
              "top_k": f.int("top_k", -1, 1 << 31), "min_p": f.float("min_p", 0, 1),
              "repetition_penalty": f.float("repetition_penalty", lo, hi),
              "max_tokens": f.int("max_new_tokens", 1, 1 << 31)}
    return {k: v for k, v in values.items() if v is not None}


def _check_generation(generation: dict, vocab: int, where: str = "generation_config.json") -> dict:
    """What a request would otherwise meet, checked at load: the stop ids, and the sampling
    defaults, which it returns."""
    Fields(generation, where).token_ids("eos_token_id", vocab)
    return sampling_defaults(generation, where)


# Ollama's parameter names for generation_config.json's
_OLLAMA_PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repeat_penalty": "repetition_penalty"}


def ollama_models() -> tuple[list[str], dict[str, str]]:
    """The models of Ollama's store neuron can serve (their weights a GGUF file of an architecture it
    reads: each file's header is read, a tenth of a second or less), and why each other one is left
    out."""
    from neuron.models.ollama_store import find_model, list_models

    served, skipped = [], {}
    for name in list_models():
        try:
            blob = find_model(name)
            arch = open_file(blob).field("general.architecture") if blob is not None else None
        except ConfigError as exc:
            skipped[name] = str(exc)
            continue
        if arch in ARCHITECTURES:
            served.append(name)
        else:
            skipped[name] = f"its GGUF architecture {arch!r:.40} is not one neuron reads ({', '.join(ARCHITECTURES)})"
    return served, skipped


def _ollama_generation(name: str, gguf: Path, config: dict, tokenizer: Tokenizer | None) -> dict:
    """A model from Ollama's store: its parameters layer as generation_config.json would hold them
    (sampling defaults under transformers' names; each stop word that is an added token, a chat
    template's marker, a stop id beside the file's own, as Ollama stops at it). {} for any other
    model, or one that leaves them out. `num_predict` is the default max_tokens. Other stop words,
    and Ollama's other parameters (num_ctx, ...), are not read."""
    from neuron.models.ollama_store import find_model, parameters

    blob = find_model(name)
    if blob is None or blob.resolve() != gguf.resolve():
        return {}
    params = parameters(name) or {}
    generation = {ours: params[theirs] for theirs, ours in _OLLAMA_PARAMETERS.items() if theirs in params}
    predict = params.get("num_predict")
    if predict is not None and not (isinstance(predict, int) and predict <= 0):  # -1, -2: no limit, fill the context
        generation["max_new_tokens"] = predict  # checked with the other defaults
    stops = params.get("stop")
    if isinstance(stops, str):
        stops = [stops]
    ids = [tokenizer.added_token_id(s) for s in stops if isinstance(s, str)] if stops and tokenizer is not None else []
    if any(i is not None for i in ids):
        own = config.get("eos_token_id")
        own = [] if own is None else [own] if isinstance(own, int) else list(own)
        generation["eos_token_id"] = list(dict.fromkeys([*own, *(i for i in ids if i is not None)]))
    return generation


def _eos_ids(config: dict, generation: dict, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Every stop id: generation_config.json's (Llama 3's three), else config.json's, and the
    tokenizer's EOS token."""
    ids = generation.get("eos_token_id", config.get("eos_token_id", text_config(config).get("eos_token_id")))
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def _max_model_len(spec: EngineConfig, config: dict, trained: int | None = None) -> int:
    """--max-model-len, checked against the model's positions; unset, the model's limit (the
    length a sentence-transformers checkpoint was trained to, `trained`, where that is shorter),
    capped at MAX_MODEL_LEN_CAP."""
    native = context_length(config)
    if spec.max_model_len is None:
        return min(native, trained or native, MAX_MODEL_LEN_CAP)
    if not 1 < spec.max_model_len <= native:
        raise ConfigError(f"max_model_len must be in 2..{native} (the model's max_position_embeddings, stretched "
                          f"by its rope scaling if it has one), got {spec.max_model_len}")
    return spec.max_model_len


def _vision(config: dict, model_dir: Path) -> VisionSpec | None:
    """How the checkpoint takes images (preprocessor_config.json's sizes beside config.json's
    vision_config); None when it has no vision tower, in its config or its weights."""
    if config.get("model_type") not in MULTIMODAL_MODEL_TYPES:
        return None
    path = model_dir / "preprocessor_config.json"
    spec = VisionSpec.from_configs(config, read_json(path) if path.is_file() else {})
    if spec is None:
        return None
    with CheckpointReader(safetensors_files(model_dir)) as reader:
        return spec if reader.has("model.visual.patch_embed.proj.weight") else None


def _speculative(spec: EngineConfig, config: dict) -> SpeculativeConfig | None:
    speculative = SpeculativeConfig.parse(spec.speculative_config)
    if speculative is not None and is_encoder(config):
        raise ConfigError(f"speculative decoding is not available for model_type {config.get('model_type')!r}: an "
                          "encoder generates nothing")
    if speculative is not None and not supports_prefix_caching(config):
        raise ConfigError(f"speculative decoding is not available for model_type {config.get('model_type')!r}: "
                          "its recurrent layers' state cannot be rolled back past rejected tokens")
    return speculative


_LORA_MODEL_TYPES = (*DENSE_MODEL_TYPES, "qwen3_moe")


def _check_lora(spec: EngineConfig, config: dict) -> None:
    """LoRA adapters run on the dense decoders' layers and on Qwen3-MoE's attention and dense MLPs,
    without speculative decoding."""
    if not spec.enable_lora:
        return
    if config.get("model_type") not in _LORA_MODEL_TYPES:
        raise ConfigError(f"LoRA adapters are not supported for model_type {config.get('model_type')!r} (they run "
                          f"on {', '.join(_LORA_MODEL_TYPES)})")
    if spec.speculative_config is not None:
        raise ConfigError("speculative decoding with LoRA adapters is not supported: drop --speculative-config or "
                          "--enable-lora")


def _prefix_caching(spec: EngineConfig, config: dict) -> bool:
    """On for every model whose layers can share prefixes, unless turned off; asked for (True) on
    one that cannot, refused."""
    if spec.enable_prefix_caching and not supports_prefix_caching(config):
        why = "an encoder attends both ways and keeps nothing between steps" if is_encoder(config) else \
            "its recurrent layers keep state that cannot be shared between sequences"
        raise ConfigError(f"prefix caching is not available for model_type {config.get('model_type')!r}: {why}")
    return spec.enable_prefix_caching is not False and supports_prefix_caching(config)


# ---- what it is served for: generation, embeddings (engine/pooling.py) ----------------------------

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# sentence-transformers' pooling flags, as neuron's modes
_MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
          "pooling_mode_cls_token": "cls"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def _tasks(task: str, model_dir: Path, config: dict, weights: list[str], gguf: Path | None,
           tokenizer) -> tuple[frozenset[str], PoolingConfig | None]:
    """What the model serves (`task`: auto, generate, embed, generate,embed or classify) and, when
    it pools, how: from the checkpoint's sentence-transformers files, else the last token,
    normalized; a classifier's last token through its head (engine/classifier.py). `auto` embeds
    when those files say the checkpoint is a pooling model, classifies when config.json names a
    sequence-classification architecture (or --hf-overrides a head from named tokens)."""
    found = sentence_transformers_pooling(model_dir) or (gguf_pooling(open_file(gguf)) if gguf is not None else None)
    encoder = is_encoder(config)
    if task == "auto":
        task = CLASSIFY if is_classification(config) else EMBED if found is not None or encoder else GENERATE
    tasks = frozenset(task.split(","))
    if encoder and GENERATE in tasks:
        raise ConfigError(f"model_type {config['model_type']!r} is an encoder: it generates nothing; serve it with "
                          "--task embed, or classify for a sequence-classification checkpoint")
    if CLASSIFY in tasks:
        # an encoder's head reads its first token (BERT's [CLS], RoBERTa's <s>), a decoder's its last
        head = load_classifier(text_config(config), weights, gguf, tokenizer)
        return tasks, PoolingConfig(_head_pooling(config) if encoder else "lasttoken", False, head)
    if EMBED not in tasks:
        return tasks, None
    # without sentence-transformers' files: an encoder's first token, a decoder's last, normalized
    return tasks, found or PoolingConfig("cls" if encoder else "lasttoken")


def _head_pooling(config: dict) -> str:
    """What an encoder's classification head reads: its first token, or ModernBERT's mean where its
    config's classifier_pooling says so."""
    pooled = config.get("classifier_pooling", "cls") if config.get("model_type") == "modernbert" else "cls"
    if pooled not in ("cls", "mean"):
        raise ConfigError(f"classifier_pooling must be cls or mean, got {pooled!r:.40}")
    return pooled


def _typed_pairs(config: dict, tokenizer: Tokenizer) -> bool:
    """Whether a pair's input marks its second text as the second token type: an encoder that
    embeds two types (BERT's; RoBERTa's one reads every token as the first, as transformers' RoBERTa
    tokenizer hands it none) whose tokenizer's pair template types it so."""
    if not is_encoder(config) or token_types(config) < 2:
        return False
    try:
        return tokenizer.second_type_at is not None
    except TokenizerError as exc:
        raise ConfigError(f"the tokenizer's pair template: {exc}") from None


def _check_lm_head(config: dict, files: list[Path]) -> None:
    """Refuse to generate from a checkpoint of the dense families without an LM head whose
    embeddings are not tied to one (a sequence-classification or embedding checkpoint): its
    tokens would come from the embedding matrix, which is no head."""
    if config.get("model_type") not in (*DENSE_MODEL_TYPES, "qwen3_moe") or config.get("tie_word_embeddings"):
        return
    reader = CheckpointReader(files)
    try:
        if any(name.startswith("lm_head.") for name in reader.names()):  # a quantized head's parts too
            return
    finally:
        reader.close()
    raise ConfigError("this checkpoint has no LM head (lm_head.weight) and its embeddings are not tied to one: it "
                      "cannot generate; serve it for what it is (--task embed, or classify for a "
                      "sequence-classification checkpoint)")


# llama.cpp's pooling types ({arch}.pooling_type): 0 none (a generation model), 4 rank (a reranker's head)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}


def gguf_pooling(f: GGUFFile) -> PoolingConfig | None:
    """The pooling a GGUF embedding model's metadata declares (`{arch}.pooling_type`: mean, first
    or last token), normalized as llama.cpp's server and Ollama return embeddings; None for a
    generation model, and for rank pooling over a cross-encoder's head (cls.output). Rank pooling
    without one is refused, saying how a causal LM reranker is served."""
    key = f"{f.field('general.architecture')}.pooling_type"
    kind = f.field(key)
    if kind is None:
        return None
    if isinstance(kind, bool) or not isinstance(kind, int):
        raise ConfigError(f"{f.path.name}: GGUF metadata {key} must be an integer (llama.cpp's pooling type), got "
                          f"{kind!r:.40}")
    if kind == 0 or (kind == 4 and "cls.output.weight" in f.tensors):  # rank: a cross-encoder's head scores
        return None
    if kind not in _GGUF_POOLING:
        raise ConfigError(f"{f.path.name}: GGUF pooling type {kind} is not supported (mean, cls and last are; "
                          "a reranker converted with rank pooling is not: serve its causal LM with "
                          "classifier_from_token in --hf-overrides)")
    return PoolingConfig(_GGUF_POOLING[kind], True)


@dataclass(frozen=True, slots=True)
class SentenceBertConfig:
    """sentence_bert_config.json, as sentence-transformers and vLLM read it: `max_seq_length`, the
    input length the checkpoint was trained to and its library cuts at (all-MiniLM-L6-v2's 256),
    the default model length; `do_lower_case`, every text lowercased before the tokenizer sees it."""

    max_seq_length: int | None = None
    do_lower_case: bool = False

    @classmethod
    def read(cls, model_dir: Path) -> SentenceBertConfig:
        """The checkpoint's (defaults without one), each field refused by name where it is wrong."""
        path = model_dir / "sentence_bert_config.json"
        cfg = read_json(path) if path.is_file() else {}
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path}: expected an object (max_seq_length, do_lower_case)")
        length, lower = cfg.get("max_seq_length"), cfg.get("do_lower_case", False)
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 2):
            raise ConfigError(f"{path}: max_seq_length must be an integer of at least 2, got {length!r:.40}")
        if not isinstance(lower, bool):
            raise ConfigError(f"{path}: do_lower_case must be true or false, got {lower!r:.40}")
        return cls(length, lower)


def sentence_transformers_pooling(model_dir: Path) -> PoolingConfig | None:
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


def _stored_label(gguf: Path | None, stored: dict | None) -> str | None:
    """How a checkpoint stores its weights when quantized: a GGUF file's types, or the method."""
    if gguf is not None:
        return f"gguf: {open_file(gguf).types()}"
    if stored is None:
        return None
    bits = f" {stored['bits']}-bit" if "bits" in stored else ""
    return f"{stored['method']}{bits}"

