"""The offline API, in the convention users know from vLLM:

    with LLM(model="path-or-repo-id", tensor_parallel_size=2) as llm:
        outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))

    with LLM(model="Qwen/Qwen3-Embedding-0.6B", task="embed") as llm:
        vectors = [o.outputs.embedding for o in llm.embed(["Hello", "World"])]
"""

from __future__ import annotations

import atexit
import base64
import io
import itertools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from neuron.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from neuron.engine.engine_client import pair_text
from neuron.engine.input_processor import check_cache_salt, kept_tokens
from neuron.engine.llm_engine import EngineConfig, LLMEngine, Update, encode_prompt
from neuron.engine.lora import LoRARequest
from neuron.engine.parallel_sampling import cumulative_logprob, ranked, sample_id, sample_params
from neuron.engine.pooling import CLASSIFY, EMBED, PoolingParams, cosine_similarities
from neuron.engine.sampling_params import SEED_RANGE, SamplingParams, token_ids
from neuron.errors import NeuronError
from neuron.multimodal.image import ImageInput


class Logprob(float):
    """A token's logprob as vLLM gives it: the value itself (a float, as these entries always
    were), with `logprob`, `rank` (its place in the vocabulary, 1 the most likely) and
    `decoded_token` (its text alone; None without a tokenizer)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        out = super().__new__(cls, logprob)
        out.rank, out.decoded_token = rank, decoded_token
        return out

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # SamplingParams.prompt_logprobs
    # with them: each prompt token's rank in the vocabulary (1: the most likely; vLLM's Logprob.rank)
    prompt_token_ranks: list[int | None] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One input's embedding, as vLLM's `LLM.embed` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]


@dataclass(slots=True)
class ClassificationRequestOutput:
    """One input's label probabilities, as vLLM's `LLM.classify` returns them."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass(slots=True)
class PoolingOutput:
    data: torch.Tensor


@dataclass(slots=True)
class PoolingRequestOutput:
    """One input's pooled output, as vLLM's `AsyncLLM.encode` yields it: an embedding, or a
    classifier's label probabilities."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ScoringRequestOutput:
    """One pair's score, as vLLM's `LLM.score` returns it."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


PromptType = str | dict | list[int]
# What a prompt dict may hold (vLLM's TextPrompt and TokensPrompt, as far as neuron takes them).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"})


@dataclass(slots=True)
class _Prompt:
    """One prompt as the engine takes it: token ids with image placeholders expanded, checked images,
    and the cache salt that decides with which requests it shares cached prefix blocks."""

    text: str | None
    ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    cache_salt: str | None = None
    types_from: int | None = None  # an encoder's input of two texts: where its second token type starts


def engine_config(
    model: str | None = None,
    task: str | None = None,
    tensor_parallel_size: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    download_dir: str | None = None,
    block_size: int | None = None,
    kv_cache_memory: int | str | None = None,
    kv_cache_dtype: str | None = None,
    gpu_memory_utilization: float | None = None,
    enable_prefix_caching: bool | None = None,
    hf_overrides: dict | None = None,
    quantization: str | None = None,
    tokenizer: str | None = None,
    speculative_config: dict | str | None = None,
    hosts: str | None = None,
    worker_launcher: str | None = None,
    cluster_address: str | None = None,
    cluster_interface: str | None = None,
    cluster_port: int | None = None,
    enable_lora: bool | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    max_num_batched_tokens: int | None = None,
    served_model_name: str | None = None,
    seed: int | None = None,
    trust_remote_code: bool = False,
    **kwargs,
) -> tuple[EngineConfig, int | None]:
    """The engine an offline API (LLM, AsyncLLM) runs, from vLLM's argument names; an argument left at
    None takes its setting (neuron.config: NEURON_* or the default). `seed` seeds the sampler's
    random state at start (returned, for the caller to apply); `trust_remote_code` is taken and
    changes nothing, since neuron never runs code a checkpoint ships."""
    if kwargs:
        raise TypeError(f"got unsupported arguments: {', '.join(sorted(kwargs))}")
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be true or false, got {trust_remote_code!r:.40}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed!r:.40}")
    given = dict(model=model, task=task, tp=tensor_parallel_size, device=device, dtype=dtype,
                 max_model_len=max_model_len, max_num_seqs=max_num_seqs, hf_cache_dir=download_dir,
                 block_size=block_size,
                 kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                 gpu_memory_utilization=gpu_memory_utilization,
                 enable_prefix_caching=enable_prefix_caching, hf_overrides=hf_overrides,
                 quantization=quantization, tokenizer=tokenizer, speculative_config=speculative_config,
                 hosts=hosts, worker_launcher=worker_launcher, cluster_address=cluster_address,
                 cluster_interface=cluster_interface, cluster_port=cluster_port, enable_lora=enable_lora,
                 max_loras=max_loras, max_lora_rank=max_lora_rank,
                 max_num_batched_tokens=max_num_batched_tokens, served_model_name=served_model_name)
    return EngineConfig(**{k: v for k, v in given.items() if v is not None}), seed


class LLM:
    """An argument left at None takes its setting (neuron.config: NEURON_* or the default). As in
    vLLM, `seed` seeds the sampler's random state at start, so a script's runs draw the same tokens
    for requests without a seed of their own; `trust_remote_code` is taken and changes nothing, since
    neuron never runs code a checkpoint ships."""

    def __init__(self, model: str | None = None, **engine_args):
        """`engine_args`: those of `engine_config` (vLLM's names: tensor_parallel_size, dtype,
        max_model_len, ...)."""
        cfg, seed = engine_config(model, **engine_args)
        self.engine = LLMEngine.load(cfg)
        if seed is not None:  # the draws of requests without a seed come from the global generator
            torch.manual_seed(seed)
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, _shutdown_engine, self.engine)
        atexit.register(self._finalizer)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params samples with: the checkpoint's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over
        SamplingParams' own defaults, as vLLM."""
        return SamplingParams(**self.engine.model.default_sampling())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order, each with
        `n` samples (`outputs[i].index == i`; see parallel_sampling for seeds and best_of).
        `lora_request`: the LoRA adapter every prompt runs, or one per prompt (None: the base model);
        an adapter is loaded the first time a request names it. `use_tqdm`: a progress bar over the
        prompts on a terminal (a callable makes the bar, as in vLLM); `priority`: only 0, the
        scheduling being first come, first served."""
        prompts = _prompt_list(prompts)
        _check_priority(priority, len(prompts))
        params = sampling_params or self.get_default_sampling_params()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        # every prompt checked before any is queued
        tokenized = [truncated_prompt(self.engine, tokenized_prompt(self.engine, prompt), p.truncate_prompt_tokens)
                     for prompt, p in zip(prompts, params_list)]
        adapters = self._adapters(lora_request, len(prompts))
        samples = [sample_params(p) for p in params_list]
        for prompt, children in zip(tokenized, samples):
            self.engine.inputs.validate(prompt.ids, children[0], prompt.images)
        if self.engine.failure is not None:  # a rank died since the last call: bring the ranks back first
            self.engine.recover()
        routes: dict[str, tuple[RequestOutput, int]] = {}
        outputs = [self._add(prompt, children, routes, lora) for prompt, children, lora in zip(tokenized, samples,
                                                                                               adapters)]
        self._run(routes, use_tqdm)
        for out, p in zip(outputs, params_list):
            _keep_best(out, p)
        return outputs

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
                    use_tqdm: bool | Callable[..., Any] = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): each prompt's `params.beam_width` best beams,
        best first, each with its tokens and text (the prompt's and its own, as vLLM's), cumulative
        logprob and finish reason. Every prompt's beams step together, one token a step."""
        prompts = _prompt_list(prompts)
        tokenized = [tokenized_prompt(self.engine, prompt) for prompt in prompts]
        if any(p.images for p in tokenized):
            raise ValueError("beam search takes text or token prompts, not images")
        adapters = self._adapters(lora_request, len(prompts))
        step = params.step_params()
        for prompt in tokenized:
            self.engine.inputs.validate(prompt.ids, step)
        searches = [BeamSearch(p.ids, params, self.engine.inputs.eos_token_ids, self.engine.inputs.max_model_len)
                    for p in tokenized]
        bar = _progress_bar(use_tqdm, params.max_tokens)
        try:
            while live := [k for k, s in enumerate(searches) if not s.done]:
                # every live beam of every prompt, with its prompt's salt and adapter
                beams = [(k, beam) for k in live for beam in searches[k].beams]
                prompts_now = [{"prompt_token_ids": beam.tokens} | _salted(tokenized[k].cache_salt)
                               for k, beam in beams]
                loras = [adapters[k] for k, _ in beams] if any(adapters) else None
                outs = self.generate(prompts_now, step, loras, use_tqdm=False)
                for k in live:
                    searches[k].advance([{t: float(lp) for t, lp in out.outputs[0].logprobs[0].items()}
                                         for (owner, _), out in zip(beams, outs) if owner == k])
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        tok = self.engine.tokenizer
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = tok.decode(beam.tokens[: s.prompt_len] + s.output_ids(beam)) if tok is not None else None
            results.append(BeamSearchOutput(best))
        return results

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType], *,
              truncate_prompt_tokens: int | None = None, pooling_params: PoolingParams | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """vLLM's score: `data_1` one prompt against each of `data_2`, or a list as long as `data_2`,
        pairwise. An embedding model scores a pair by the cosine similarity of its embeddings; a
        cross-encoder (a one-label classification model) encodes the two texts as one input and
        scores it by its head's sigmoid (`pooling_params.use_activation` false: the logit); `truncate_prompt_tokens`
        then bounds each pair's whole input, cutting the texts as transformers does. A cross-encoder
        joins the texts by the tokenizer's pair template, an LLM reranker (a head from named
        tokens) as one text (engine/classifier.py); `chat_template` (or the engine's) renders the
        pair as a query message and a document message instead, as vLLM's score templates do."""
        first, second = _prompt_list(data_1), _prompt_list(data_2)
        m, n = len(first), len(second)
        if not n or m not in (1, n):
            raise ValueError(f"data_1 has {m} prompts and data_2 {n}: give one data_1, or as many as data_2")
        firsts = [0] * n if m == 1 else list(range(n))
        if self.engine.model.classifier is not None:
            activation = pooling_params is None or pooling_params.use_activation is not False
            return self._cross_encode([(first[a], b) for a, b in zip(firsts, second)], truncate_prompt_tokens,
                                      activation, chat_template)
        outs = self.embed(first + second, truncate_prompt_tokens=truncate_prompt_tokens)  # data_1 once each
        scores = cosine_similarities([o.outputs.embedding for o in outs], firsts, list(range(m, m + n)))
        return [ScoringRequestOutput(f"{outs[a].request_id}-{b.request_id}", ScoringOutput(s),
                                     outs[a].prompt_token_ids + b.prompt_token_ids)
                for a, b, s in zip(firsts, outs[m:], scores)]

    def _cross_encode(self, pairs: list[tuple[PromptType, PromptType]], keep: int | None, use_activation: bool,
                      chat_template: str | None) -> list[ScoringRequestOutput]:
        head = self.engine.model.classifier
        if head.num_labels != 1:
            raise NeuronError(f"this model classifies into {head.num_labels} labels; scoring a pair needs a one-label "
                              "head (a cross-encoder): use classify")
        if self.engine.tokenizer is None:
            raise NeuronError("this checkpoint has no tokenizer.json: a pair of texts cannot be scored")
        if not all(isinstance(a, str) and isinstance(b, str) for a, b in pairs):
            raise ValueError("a cross-encoder scores pairs of texts: data_1 and data_2 must be strings")
        room = kept_tokens(keep, self.engine.model.max_model_len)
        if room is not None and room < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")
        tok = self.engine.tokenizer
        if chat_template is None and self.engine.model.spec.chat_template is not None:
            chat_template = tok.chat_template  # the engine's --chat-template
        if head.sep and chat_template is None:  # a cross-encoder: the pair template, each text encoded once
            encoded = {t: tok.encode(t) for t in dict.fromkeys(t for pair in pairs for t in pair)}
            joined = [tok.join_pair(encoded[a], encoded[b], room) for a, b in pairs]
            inputs = [_Prompt(None, ids, types_from=at) for ids, at in joined]
        else:  # an LLM reranker, or any with a score template: the pair as one text, as vLLM encodes it
            inputs = [_Prompt(None, tok.join_single(tok.encode(pair_text(tok, a, b, chat_template)), room))
                      for a, b in pairs]
        outs = self._pooled(inputs, PoolingParams(task=CLASSIFY))
        return [ScoringRequestOutput(rid, ScoringOutput(head.probabilities(v)[0] if use_activation else v[0]), i)
                for rid, i, v in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, pooling_params: PoolingParams | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (a model served with task classify), in prompt order:
        a one-label head's sigmoid, several labels' softmax (`pooling_params.use_activation` false:
        the logits). `truncate_prompt_tokens` (or the pooling params'): classify each prompt's last
        this many tokens."""
        head = self.engine.model.classifier
        if head is None:
            raise NeuronError("this model does not classify: load a *ForSequenceClassification checkpoint, or one "
                              "with task=\"classify\" and classifier_from_token in hf_overrides")
        params = replace(pooling_params or PoolingParams(), task=CLASSIFY)
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        outs = self._pooled(self._pooling_prompts(prompts, params, "classification"), params)
        activation = params.use_activation is not False
        return [ClassificationRequestOutput(rid, i, ClassificationOutput(head.probabilities(v) if activation else v))
                for rid, i, v in outs]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (a model served with task embed, or generate,embed), batched
        together, in prompt order. `pooling_params.dimensions`: keep the first this many values
        (Matryoshka), normalized again where the model normalizes. `truncate_prompt_tokens` (or the
        pooling params'): embed each prompt's last this many tokens (-1: as many as the context holds)."""
        if self.engine.model.pooling is None or self.engine.model.classifier is not None:
            raise NeuronError("this model does not embed: load it with task=\"embed\" (or \"generate,embed\")")
        params = replace(pooling_params or PoolingParams(), task=EMBED)
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        outs = self._pooled(self._pooling_prompts(prompts, params, "embeddings"), params)
        return [EmbeddingRequestOutput(rid, i, EmbeddingOutput(v)) for rid, i, v in outs]

    def _pooling_prompts(self, prompts: PromptType | Sequence[PromptType], params: PoolingParams,
                         what: str) -> list[_Prompt]:
        tokenized = [truncated_prompt(self.engine, tokenized_prompt(self.engine, prompt, pooling=True),
                                      params.truncate_prompt_tokens) for prompt in _prompt_list(prompts)]
        if any(prompt.images for prompt in tokenized):
            raise ValueError(f"{what} take text or token ids, not images")
        return tokenized

    def _pooled(self, prompts: list[_Prompt], params: PoolingParams) -> list[tuple[str, list[int], list[float]]]:
        """Each prompt's pooled vector (an embedding, or a classifier's logits), batched together:
        (request id, prompt ids, vector) in prompt order."""
        for prompt in prompts:
            self.engine.inputs.admit_pooling(prompt.ids, prompt.types_from)
        if self.engine.failure is not None:
            self.engine.recover()
        vectors: dict[str, list[float]] = {}
        order = []
        for prompt in prompts:
            rid = str(next(self._ids))
            self.engine.add_request(rid, prompt.ids, params, cache_salt=prompt.cache_salt, types_from=prompt.types_from)
            vectors[rid] = []
            order.append((rid, prompt.ids))

        def take(u: Update) -> None:
            if u.finished:
                vectors[u.request_id] = u.embedding

        self._drain(set(vectors), take, "embedding")
        return [(rid, ids, vectors[rid]) for rid, ids in order]

    def _drain(self, pending: set[str], take: Callable[[Update], None], what: str) -> None:
        """Step until each of these requests has its final update, handing each of their updates to
        `take`. A failed one raises, after the others were aborted and drained, so none keeps running
        unseen in the engine."""
        failure = None
        while pending:
            for u in self.engine.step():
                if u.request_id not in pending:
                    continue
                take(u)
                if not u.finished:
                    continue
                pending.discard(u.request_id)
                if u.error and failure is None:
                    failure = u.error
                    for rid in pending:
                        self.engine.abort(rid)
        if failure is not None:
            raise NeuronError(f"{what} failed: {failure}")

    def _adapters(self, requests: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[str | None]:
        """The adapter name of each of `n` prompts, every adapter registered (checked) first."""
        if requests is None:
            return [None] * n
        if isinstance(requests, LoRARequest):
            requests = [requests] * n
        if len(requests) != n:
            raise ValueError(f"{n} prompts but {len(requests)} LoRA requests")
        if self.engine.loras is None and any(r is not None for r in requests):
            raise NeuronError("LoRA requests need LLM(..., enable_lora=True)")
        return [None if r is None else self.engine.loras.resolve(r).name for r in requests]

    def _add(self, prompt: _Prompt, children: list[SamplingParams],
             routes: dict[str, tuple[RequestOutput, int]], lora: str | None = None) -> RequestOutput:
        """Queue one prompt's samples, all with its salt (they share its prefill); `routes` learns
        which output each engine request fills."""
        rid = str(next(self._ids))
        out = RequestOutput(rid, prompt.text, prompt.ids)
        for i, child in enumerate(children):
            sid = sample_id(rid, i, len(children))
            self.engine.add_request(sid, prompt.ids, child, prompt.images, cache_salt=prompt.cache_salt, lora=lora)
            out.outputs.append(CompletionOutput(i, "", [], None, [] if child.logprobs is not None else None, None))
            routes[sid] = (out, i)
        return out

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, **template_kwargs) -> list[RequestOutput]:
        """Chat turns through the checkpoint's template (or `chat_template`), with vLLM's arguments.
        Content may be a list of parts: text (`{"type": "text", "text": ...}`) and, for vision
        models, images (`{"type": "image_url", "image_url": {"url": "data:..."}}` or `{"type":
        "image", "image": <PIL image>}`). `continue_final_message`: the reply continues the last
        (assistant) message rather than opening a turn of its own. `chat_template_kwargs` (and any
        other keyword) reach the template, as `enable_thinking` for Qwen3."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self._need_tokenizer()
        kwargs = {**template_kwargs, **(chat_template_kwargs or {})}
        prompts = []
        for conversation in conversations:
            shaped, images = chat_images(conversation)
            text = tok.apply_chat_template(shaped, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tools=tools,
                                           chat_template=chat_template, **kwargs)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params, lora_request, use_tqdm=use_tqdm)

    def _need_tokenizer(self):
        if self.engine.tokenizer is None:
            raise NeuronError("this checkpoint has no tokenizer.json")
        return self.engine.tokenizer

    def _run(self, routes: dict[str, tuple[RequestOutput, int]], use_tqdm: bool | Callable[..., Any] = False) -> None:
        """Step until every sample of this call finished (see _drain), a bar counting the prompts."""
        bar = _progress_bar(use_tqdm, len({id(out) for out, _ in routes.values()}))

        decode = token_decoder(self.engine.tokenizer)

        def take(u: Update) -> None:
            out, i = routes[u.request_id]
            apply_update(out, i, u, decode)
            if u.finished:
                out.finished = all(c.finish_reason is not None for c in out.outputs)
                if out.finished and bar is not None:
                    bar.update(1)

        try:
            self._drain(set(routes), take, "generation")
        finally:
            if bar is not None:
                bar.close()

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()



def tokenized_prompt(engine: LLMEngine, prompt: PromptType, pooling: bool = False) -> _Prompt:
    """One prompt of the offline APIs: a string, token ids, or a dict of vLLM's keys (`prompt` or `prompt_token_ids`,
    and `multi_modal_data`, `cache_salt`; with `pooling`, for embed, classify and encode, `token_type_ids` beside
    `prompt_token_ids`: an encoder's two texts)."""
    if isinstance(prompt, str):
        return _Prompt(prompt, encode_prompt(engine, prompt))
    if not isinstance(prompt, dict):
        return _Prompt(None, token_ids(prompt, "prompt"))
    keys = _PROMPT_KEYS | {"token_type_ids"} if pooling else _PROMPT_KEYS
    unknown = set(prompt) - keys
    if unknown:  # refused, not ignored: a key neuron does not read would do nothing
        why = "; token_type_ids are read by an encoder's embed, classify and score" * ("token_type_ids" in unknown)
        raise ValueError(f"a prompt dict takes {', '.join(sorted(keys))}; got {', '.join(sorted(unknown))}{why}")
    if "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), token_ids(prompt["prompt_token_ids"], "prompt_token_ids")
    elif "prompt" in prompt:
        text, ids = prompt["prompt"], encode_prompt(engine, prompt["prompt"])
    else:
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    salt = prompt.get("cache_salt")
    check_cache_salt(salt)
    images = _images(engine, prompt.get("multi_modal_data"))
    if images:
        ids = engine.inputs.expand_images(ids, images)
    types = prompt.get("token_type_ids")
    types_from = None if types is None else _second_type_from(types, ids, "prompt_token_ids" in prompt)
    return _Prompt(text, ids, images, salt, types_from)


def _second_type_from(types, ids: list[int], given_ids: bool) -> int | None:
    """vLLM's `token_type_ids` of a tokens prompt, one per token: zeros, then ones from where an
    encoder's second text starts (as a tokenizer types a pair); that position, None when all are 0."""
    if not given_ids:
        raise ValueError("token_type_ids go with prompt_token_ids, one per token")
    if not isinstance(types, (list, tuple)) or len(types) != len(ids) or \
            any(type(t) is not int or t not in (0, 1) for t in types):
        raise ValueError(f"token_type_ids must be a list of {len(ids)} zeros and ones, one per token")
    start = list(types).index(1) if 1 in types else len(types)
    if any(t != 1 for t in types[start:]):
        raise ValueError("token_type_ids must be zeros, then ones from where the second text starts")
    return start if start < len(types) else None

def truncated_prompt(engine: LLMEngine, prompt: _Prompt, keep: int | None) -> _Prompt:
    """The prompt cut to its last `keep` tokens (truncate_prompt_tokens); its text stays as given."""
    ids = engine.inputs.truncated(prompt.ids, keep, prompt.images)
    if ids is not prompt.ids and prompt.types_from is not None:
        raise ValueError("truncate_prompt_tokens would cut a prompt with token_type_ids: cut its texts before")
    return prompt if ids is prompt.ids else replace(prompt, ids=ids)

def _images(engine: LLMEngine, data: dict | None) -> list[ImageInput]:
    """`multi_modal_data={"image": ...}`: one image or a list, each a base64 `data:` URI or a
    PIL image, filling the prompt's image placeholders in order."""
    if not data:
        return []
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data supports only 'image', got {', '.join(sorted(unknown))}")
    items = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
    return engine.inputs.check_images([image_data_uri(x) for x in items])


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, or token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, (str, dict)) or (len(prompts) and _is_id(prompts[0])):
        return [prompts]
    return list(prompts)


def _salted(salt: str | None) -> dict:
    return {"cache_salt": salt} if salt else {}


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int):
    """vLLM's `use_tqdm`: True, a tqdm bar where stderr is a terminal; a callable, the bar it makes."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    if not use_tqdm or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt", file=sys.stderr)


def _check_priority(priority: int | Sequence[int] | None, n: int) -> None:
    """vLLM's `priority`, where its scheduling is first come, first served: 0 for every prompt."""
    if priority is None:
        return
    values = [priority] * n if isinstance(priority, int) else list(priority)
    if len(values) != n:
        raise ValueError(f"{n} prompts but {len(values)} priorities")
    if any(v != 0 for v in values):
        raise ValueError("priority scheduling is not supported: requests run first come, first served "
                         "(leave priority out, or 0)")


def _is_id(value) -> bool:
    """A token id rather than a prompt: anything Python counts as an integer (numpy's included)."""
    return hasattr(value, "__index__") and not isinstance(value, (list, tuple, dict, str))


def token_decoder(tokenizer) -> Callable[[int], str | None]:
    """A token's text alone, as a logprob entry names it (None without a tokenizer)."""
    def decode(token: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)

    return decode


def apply_update(out: RequestOutput, i: int, u: Update, decode: Callable[[int], str | None]) -> None:
    """One engine update of sample i into the request's output: its text, tokens, logprobs and end,
    and the prompt's logprobs where the first update carries them."""
    _apply(out.outputs[i], u, decode)
    if u.prompt_logprobs is not None and out.prompt_logprobs is None:
        out.prompt_logprobs = [None if e is None else _logprobs(e, rank, decode)
                               for e, rank in zip(u.prompt_logprobs, u.prompt_token_ranks)]
        out.prompt_token_ranks = u.prompt_token_ranks


def _apply(c: CompletionOutput, u: Update, decode: Callable[[int], str | None]) -> None:
    c.token_ids.extend(u.token_ids)
    c.text += u.text
    if u.logprobs is not None:
        ranks = u.token_ranks or [None] * len(u.logprobs)
        c.logprobs.extend(_logprobs(entry, rank, decode) for entry, rank in zip(u.logprobs, ranks))
    if u.finished:
        c.finish_reason, c.stop_reason = u.finish_reason, u.stop_reason
        if c.logprobs:
            c.cumulative_logprob = cumulative_logprob(c.token_ids, c.logprobs)


def _logprobs(entry: dict[int, float], first_rank: int | None,
              decode: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One position's entry as vLLM's Logprob objects. The first id (the sampled or prompt token)
    has the rank the engine found in the whole vocabulary; the others are the top ones, each
    ranked by the entries above it (every token above one of the top k is among them)."""
    values = list(entry.values())
    out = {}
    for k, (token, value) in enumerate(entry.items()):
        rank = first_rank if k == 0 else 1 + sum(v > value for v in values)
        out[token] = Logprob(value, rank, decode(token))
    return out


def _keep_best(out: RequestOutput, params: SamplingParams) -> None:
    """Of best_of samples, the n to return, indexed 0..n-1; logprobs the request did not ask for
    (taken to rank them) are dropped, their sum stays as cumulative_logprob."""
    if len(out.outputs) == params.n:
        return
    best = ranked([c.cumulative_logprob or 0.0 for c in out.outputs], params.n)
    out.outputs = [out.outputs[k] for k in best]
    for i, c in enumerate(out.outputs):
        c.index = i
        if params.logprobs is None:
            c.logprobs = None


def image_data_uri(image) -> str:
    """A `data:` URI as given, or a PIL image encoded as PNG."""
    if isinstance(image, str):
        return image
    if hasattr(image, "save"):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    raise ValueError(f"an image must be a base64 data: URI or a PIL image, got {type(image).__name__}")


def chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """Messages shaped for a chat template (each image part becomes `{"type": "image"}`, which
    templates render as the image placeholder) and the images, in order."""
    shaped, images = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            shaped.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
                parts.append({"type": "image"})
            elif kind == "image":
                images.append(part.get("image"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        shaped.append({**m, "content": parts})
    return shaped, images


def _shutdown_engine(engine: LLMEngine) -> None:
    engine.shutdown()
