"""Tiny random Qwen3 checkpoints built by the tests themselves with transformers (the oracle)."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    # Wider than the usual 0.02 so random logits are well separated: greedy ties would make
    # token-equality tests flaky for reasons unrelated to correctness.
    initializer_range=0.25,
    eos_token_id=None,
    bos_token_id=None,
)

# Shapes chosen to break easy assumptions: a vocabulary no tp divides, one KV head (replicated
# on every rank), head_dim unrelated to hidden/heads, untied embeddings.
ODD = dict(BASE, vocab_size=301, num_key_value_heads=1, head_dim=24, tie_word_embeddings=False, rope_theta=1e6)


def build_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**BASE, **overrides})
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def truncated_copy(src: Path, dst: Path, layers: int) -> Path:
    """A checkpoint of `src`'s first `layers` decoder layers, its embeddings, final norm and head:
    a draft that agrees with `src` as far as the dropped layers change little."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    (dst / "config.json").write_text(json.dumps(config))
    kept = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(f).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            kept[name] = tensor
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def reference_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the log-softmax of its logits at each step."""
    from transformers import Qwen3ForCausalLM

    return greedy_with_logprobs(cached_model(Qwen3ForCausalLM, path), prompt, max_new_tokens)


def greedy_with_logprobs(model, prompt: list[int], max_new_tokens: int,
                         **inputs) -> tuple[list[int], list[torch.Tensor]]:
    """A transformers model's greedy continuation of `prompt` (extra model `inputs` such as
    pixels passed through), and the log-softmax of its logits at each step."""
    ids = torch.tensor([prompt])
    out = model.generate(  # an explicit mask: generate would otherwise treat token 0 as padding
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **inputs,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def assert_matches_reference(got, ref_tokens: list[int], ref_logprobs: list[torch.Tensor], what: str = "",
                             top: int = 5, tol: float = 1e-3) -> None:
    """An output's greedy tokens equal the reference's, its logprobs hold the reference's top `top`
    ids at every step, and each of its logprobs is within `tol` of the reference's."""
    assert got.token_ids == ref_tokens, what
    for step, lp in enumerate(got.logprobs):
        assert set(ref_logprobs[step].topk(top).indices.tolist()) <= set(lp)
        for tid, value in lp.items():
            assert abs(value - ref_logprobs[step][tid].item()) <= tol


def assert_same_outputs(a, b, tol: float = 1e-4) -> None:
    """Two runs of one request (chunked and single-shot prefill, say) give the same tokens and,
    at each step, logprobs for the same ids within `tol`."""
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        assert max(abs(x[k] - y[k]) for k in x) < tol


_MODELS: dict = {}


def assert_chunking_changes_nothing(path, prompt: list[int], chunk_tokens: int, monkeypatch) -> None:
    """`prompt` prefilled in `chunk_tokens`-token chunks and in one shot: the same tokens and
    logprobs (to 1e-4) over 4 greedy steps."""
    results = []
    for chunk in (chunk_tokens, 512):
        monkeypatch.setenv("NEURON_PREFILL_CHUNK_TOKENS", str(chunk))
        results += generate_greedy(path, 1, [prompt], 4, logprobs=3)
    assert_same_outputs(*results)


def generate_greedy(path, tp: int, prompts: list[list[int]], max_tokens: int, logprobs: int = 5) -> list:
    """Each prompt's greedy completion (EOS ignored) with its top logprobs, all prompts in one
    `generate` call through the offline API at `tp` ranks, on CPU in float32."""
    from neuron import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32") as llm:
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def model_config(path=None, **engine):
    """The resolved ModelConfig of the checkpoint at `path` (None: the embedded default) on CPU in
    float32, with `engine` (EngineConfig's fields) over that."""
    from neuron.engine.engine_config import EngineConfig
    from neuron.engine.model_config import resolve_model_config

    return resolve_model_config(EngineConfig(model=None if path is None else str(path),
                                             **{"device": "cpu", "dtype": "float32", **engine}))


def executor_config(path=None, **engine):
    """What an executor of that checkpoint brings up (model_config's arguments)."""
    return model_config(path, **engine).executor_config()


def shard_spec(path=None, **engine):
    """What each rank of that checkpoint loads (model_config's arguments)."""
    return model_config(path, **engine).shard_spec()


def cached_model(cls, path):
    """`cls.from_pretrained(path)` in float32, loaded once per path and class."""
    key = (cls, str(path))
    if key not in _MODELS:
        _MODELS[key] = cls.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[key]

# Three ranks need head counts and widths that 3 divides.
TP3 = dict(BASE, vocab_size=301, hidden_size=48, intermediate_size=96, num_attention_heads=6,
           num_key_value_heads=1, head_dim=8)


def build_embedding_checkpoint(path: Path, seed: int = 0, pooling: str = "lasttoken", normalize: bool = True,
                               **overrides) -> Path:
    """A tiny random Qwen3 embedding checkpoint laid out as Qwen3-Embedding ships: the base model
    saved alone (weight names without `model.`, no LM head) under a Qwen3ForCausalLM config, with
    sentence-transformers' modules.json and 1_Pooling/config.json (`pooling`: lasttoken, mean or
    cls), and a Normalize module when `normalize`."""
    import json

    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    config = Qwen3Config(**{**BASE, **overrides})
    model = Qwen3Model(config).eval()
    with torch.no_grad():  # a final norm of ones would vanish in the L2 normalization: no test could see it
        model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "architectures": ["Qwen3ForCausalLM"]}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size, **flags, "include_prompt": True}))
    return path


def reference_embeddings(path: Path, prompts: list[list[int]], pooling: str = "lasttoken",
                         normalize: bool = True) -> list[torch.Tensor]:
    """transformers' AutoModel over each prompt alone (fp32): its last hidden state (after the
    final norm) pooled as `pooling` says, L2-normalized when `normalize`."""
    from transformers import AutoModel

    model = cached_model(AutoModel, path)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
            v = {"lasttoken": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_llama_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama checkpoint of BASE's shape (no q/k norms, its own head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = {k: v for k, v in BASE.items() if k != "tie_word_embeddings"}
    LlamaForCausalLM(LlamaConfig(**{**shape, **overrides})).eval().save_pretrained(path, safe_serialization=True)
    return path


def build_lora_adapter(base: Path, path: Path, seed: int, r: int = 4, alpha: float = 8.0,
                       targets=LORA_TARGETS, use_rslora: bool = False, scale: float = 0.2) -> Path:
    """A PEFT LoRA adapter of the checkpoint at `base`, A and B both random (PEFT starts B at zero,
    which would make the adapter a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(path)
    return path


def lora_reference_model(base: Path, adapter: Path | None):
    """transformers' model of `base` with PEFT's `adapter` on it (None: the base), loaded once."""
    from transformers import AutoModelForCausalLM

    key = ("lora", str(base), str(adapter))
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).eval()
        _MODELS[key] = model
    return _MODELS[key]


def reference_lora_greedy(base: Path, adapter: Path | None, prompt: list[int],
                          max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers + PEFT's greedy tokens and logprobs with `adapter` on `base` (None: the base)."""
    return greedy_with_logprobs(lora_reference_model(base, adapter), prompt, max_new_tokens)
