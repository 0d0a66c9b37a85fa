"""vLLM's score, rerank and classify APIs: POST /score (and /v1/score), POST /rerank (and
/v1/rerank, /v2/rerank: Jina's and Cohere's shape; /reranking and /v1/reranking, llama-server's
names) and POST /classify.

A model that embeds scores a pair of texts as vLLM scores one with an embedding model: the cosine
similarity of their two embeddings. Every distinct text is embedded once, through the embeddings
path (`serving_embeddings`: batched with the rest, at most `max_per_request` in flight).

A classification model (engine/classifier.py) with one label is a cross-encoder: a pair is one
input, the two texts encoded together as transformers encodes a pair (Tokenizer.encode_pair), and
its score the sigmoid of the head's logit (`use_activation` false: the logit). /classify gives
each input's label probabilities and the likeliest label.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine
from neuron.engine.classifier import Classifier
from neuron.engine.input_processor import kept_tokens
from neuron.engine.llm_engine import RequestError
from neuron.engine.pooling import CLASSIFY, EMBED, cosine_similarities
from neuron.entrypoints.openai.api_errors import bad_request
from neuron.entrypoints.openai.chat_utils import check_template_kwargs
from neuron.entrypoints.openai.common import check_ready, check_serves, encoded, new_id, now
from neuron.entrypoints.openai.prompt_input import check_prompt_chars, off_loop
from neuron.entrypoints.openai.serving_embeddings import (
    MAX_INPUTS,
    EmbeddingBatch,
    embedding_inputs,
    pooling_params,
    tokenized_inputs,
)
from neuron.entrypoints.openai.streaming import json_unless_disconnected

# Characters one score or rerank request may have tokenized for an LLM reranker, which encodes each
# pair whole: a query sent with 2,048 documents is tokenized 2,048 times.
MAX_JOINED_CHARS = 16 * 2**20


class ScoreRequest(Struct, kw_only=True):
    """vLLM's: `text_1` a text or a list, `text_2` a text or a list of the same length (or any
    length against one `text_1`); `queries`/`documents` name them too."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    user: str | None = None
    use_activation: bool | None = None  # a cross-encoder's sigmoid (default) or raw logit
    max_tokens_per_query: int = 0  # vLLM's: each query cut to this many tokens (0: not cut)
    max_tokens_per_doc: int = 0  # and each document
    instruction: str | None = None  # vLLM's: chat_template_kwargs["instruction"] for a score template
    chat_template_kwargs: dict[str, Any] | None = None  # to the score template (--chat-template)


class RerankRequest(Struct, kw_only=True):
    """Jina's and Cohere's rerank request, as vLLM takes it."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None  # the best this many; None or 0: all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    use_activation: bool | None = None
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ClassifyRequest(Struct, kw_only=True):
    """vLLM's: `input` a text, token ids, or a list of either."""

    input: Any  # checked as an embedding's input (serving_embeddings.embedding_inputs)
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    user: str | None = None
    use_activation: bool | None = None  # probabilities (default) or the head's logits


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
    object: str = "list"


class ClassificationData(Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int
    object: str = "classification"


class ClassificationUsage(Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage
    object: str = "list"


class RerankDocument(Struct):
    text: str


class RerankResult(Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(Struct):
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


async def create_score(request: Request, engine: AsyncEngine, req: ScoreRequest, limiter: anyio.CapacityLimiter,
                       cache_salt: str | None) -> Response:
    first = _texts(req.text_1 if req.text_1 is not None else req.queries, "text_1")
    second = _texts(req.text_2 if req.text_2 is not None else req.documents, "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: send one text_1, or as many as "
                          "text_2", param="text_1")
    pairing = _Pairing.of(req, engine)
    pairs = await pairing.cut(engine, list(zip(first, second)), limiter)
    scorer = await _scorer(engine, pairs, pairing, limiter, cache_salt, new_id("score"))

    async def collect() -> bytes:
        scores = await scorer.scores(pairs)
        data = [ScoreData(k, s) for k, s in enumerate(scores)]
        return await encoded(ScoreResponse(scorer.batch.request_id, now(), engine.model_name, data,
                                           ScoreUsage(scorer.tokens, scorer.tokens)))

    return await json_unless_disconnected(request, scorer.batch, collect())


async def create_rerank(request: Request, engine: AsyncEngine, req: RerankRequest, limiter: anyio.CapacityLimiter,
                        cache_salt: str | None) -> Response:
    query = _texts(req.query, "query")[0]
    documents = _texts(req.documents, "documents")
    if req.top_n is not None and req.top_n < 0:
        raise bad_request(f"top_n must be 0 (all) or more, got {req.top_n}", param="top_n")
    pairing = _Pairing.of(req, engine)
    pairs = await pairing.cut(engine, [(query, d) for d in documents], limiter)
    scorer = await _scorer(engine, pairs, pairing, limiter, cache_salt, new_id("rerank"))

    async def collect() -> bytes:
        scores = await scorer.scores(pairs)
        ranked = sorted(range(len(documents)), key=lambda k: scores[k], reverse=True)[: req.top_n or None]
        results = [RerankResult(k, scores[k], RerankDocument(documents[k]) if req.return_documents else None)
                   for k in ranked]
        return await encoded(RerankResponse(scorer.batch.request_id, engine.model_name, RerankUsage(scorer.tokens),
                                            results))

    return await json_unless_disconnected(request, scorer.batch, collect())


async def create_classify(request: Request, engine: AsyncEngine, req: ClassifyRequest,
                          limiter: anyio.CapacityLimiter, cache_salt: str | None) -> Response:
    check_serves(engine, CLASSIFY)
    head = engine.classifier
    params = pooling_params(keep=req.truncate_prompt_tokens, task=CLASSIFY)
    ids = await tokenized_inputs(engine, embedding_inputs(req.input), limiter, params.truncate_prompt_tokens)
    batch = EmbeddingBatch(engine, new_id("classify"), ids, params, cache_salt)

    async def collect() -> bytes:
        logits = await batch.run()
        data = []
        for k, row in enumerate(logits):
            probs = head.probabilities(row)
            best = max(range(len(row)), key=row.__getitem__)
            data.append(ClassificationData(k, head.labels[best], probs if req.use_activation is not False else row,
                                           len(row)))
        tokens = sum(map(len, batch.ids))
        return await encoded(ClassificationResponse(batch.request_id, now(), engine.model_name, data,
                                                    ClassificationUsage(tokens, tokens)))

    return await json_unless_disconnected(request, batch, collect())


@dataclass(frozen=True, slots=True)
class _Pairing:
    """How a score or rerank request's pairs are read: `keep` (truncate_prompt_tokens) bounds each
    input, `per_query` and `per_doc` cut each text first (0: not cut), `template_kwargs` reach a
    score template; `activation`: a cross-encoder's sigmoid, or its logit."""

    keep: int | None
    activation: bool
    per_query: int
    per_doc: int
    template_kwargs: dict

    @classmethod
    def of(cls, req: ScoreRequest | RerankRequest, engine: AsyncEngine) -> "_Pairing":
        """The request's pairing, or the 400 for a bad bound or template arguments where the model
        has no score template to take them."""
        check_ready(engine)
        for name in ("max_tokens_per_query", "max_tokens_per_doc"):
            if getattr(req, name) < 0:
                raise bad_request(f"{name} must be 0 (no cut) or more, got {getattr(req, name)}", param=name)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.instruction is not None:
            kwargs.setdefault("instruction", req.instruction)
        check_template_kwargs(kwargs)
        if kwargs and not (CLASSIFY in engine.tasks and engine.templated_pairs):
            raise bad_request("instruction and chat_template_kwargs reach a score template, and this model has none "
                              "(the server's --chat-template renders a classifier's pairs)",
                              param="chat_template_kwargs")
        return cls(req.truncate_prompt_tokens, req.use_activation is not False, req.max_tokens_per_query,
                   req.max_tokens_per_doc, kwargs)

    async def cut(self, engine: AsyncEngine, pairs: list[tuple[str, str]],
                  limiter: anyio.CapacityLimiter) -> list[tuple[str, str]]:
        """The pairs with each query and document cut to its bound, at a token's end (each distinct
        text tokenized once)."""
        if not self.per_query and not self.per_doc:
            return pairs
        if len(pairs) > MAX_INPUTS:
            raise bad_request(f"the request has {len(pairs)} pairs; at most {MAX_INPUTS} are scored at once",
                              param="documents")
        cut: dict[tuple[int, str], str] = {}
        for side, bound in ((0, self.per_query), (1, self.per_doc)):
            for text in dict.fromkeys(pair[side] for pair in pairs) if bound else ():
                with _as_400():
                    cut[side, text] = await off_loop(limiter, engine.cut_text, text, bound)
        return [(cut.get((0, a), a), cut.get((1, b), b)) for a, b in pairs]


async def _scorer(engine: AsyncEngine, pairs: list[tuple[str, str]], pairing: _Pairing,
                  limiter: anyio.CapacityLimiter, cache_salt: str | None, request_id: str):
    """The scorer of these pairs: a cross-encoder's for a classification model, else the cosine
    similarity of embeddings."""
    check_ready(engine)
    if CLASSIFY in engine.tasks:
        return await _CrossEncoder.open(engine, pairs, pairing, limiter, cache_salt, request_id)
    return await _Scorer.open(engine, [t for pair in pairs for t in pair], pairing.keep, limiter, cache_salt,
                              request_id)


class _Scorer:
    """The embeddings of a request's distinct texts, and the cosine similarity of pairs of them."""

    def __init__(self, texts: list[str], batch: EmbeddingBatch):
        self.texts, self.batch = texts, batch
        self.tokens = sum(map(len, batch.ids))

    @classmethod
    async def open(cls, engine: AsyncEngine, texts: list[str], keep: int | None, limiter: anyio.CapacityLimiter,
                   cache_salt: str | None, request_id: str) -> "_Scorer":
        check_serves(engine, EMBED)
        distinct = list(dict.fromkeys(texts))
        if len(distinct) > MAX_INPUTS:
            raise bad_request(f"the request has {len(distinct)} distinct texts; at most {MAX_INPUTS} are scored at "
                              "once", param="documents")
        params = pooling_params(keep=keep, task=EMBED)
        ids = await tokenized_inputs(engine, distinct, limiter, keep)
        return cls(distinct, EmbeddingBatch(engine, request_id, ids, params, cache_salt))

    async def scores(self, pairs: list[tuple[str, str]]) -> list[float]:
        vectors = await self.batch.run()
        row = {text: k for k, text in enumerate(self.texts)}
        firsts, seconds = [row[a] for a, _ in pairs], [row[b] for _, b in pairs]
        return await anyio.to_thread.run_sync(cosine_similarities, vectors, firsts, seconds)


class _CrossEncoder:
    """A one-label classifier's score of each pair, the pair encoded as one input."""

    def __init__(self, batch: EmbeddingBatch, head: Classifier, activation: bool):
        self.batch, self.head, self.activation = batch, head, activation
        self.tokens = sum(map(len, batch.ids))

    @classmethod
    async def open(cls, engine: AsyncEngine, pairs: list[tuple[str, str]], pairing: _Pairing,
                   limiter: anyio.CapacityLimiter, cache_salt: str | None, request_id: str) -> "_CrossEncoder":
        if engine.classifier.num_labels != 1:
            raise bad_request(f"model `{engine.model_name}` classifies into {engine.classifier.num_labels} labels; "
                              "scoring a pair needs a one-label head (a cross-encoder): use /classify",
                              param="model", code="model_not_cross_encoder")
        if len(pairs) > MAX_INPUTS:
            raise bad_request(f"the request has {len(pairs)} pairs; at most {MAX_INPUTS} are scored at once",
                              param="documents")
        keep = pairing.keep
        params = pooling_params(keep=keep, task=CLASSIFY)
        room = kept_tokens(keep, engine.max_model_len)
        if engine.classifier.sep and not engine.templated_pairs:
            inputs, types_from = await _with_template(engine, pairs, room, limiter)
        else:
            inputs, types_from = await _joined(engine, pairs, room, limiter, pairing.template_kwargs), None
        # each pair is cut as a whole (join_pair, pair_as_text), not to its last tokens
        whole = replace(params, truncate_prompt_tokens=None)
        batch = EmbeddingBatch(engine, request_id, inputs, whole, cache_salt, types_from)
        return cls(batch, engine.classifier, pairing.activation)

    async def scores(self, pairs: list[tuple[str, str]]) -> list[float]:
        logits = await self.batch.run()
        return [self.head.probabilities(row)[0] if self.activation else row[0] for row in logits]


async def _with_template(engine: AsyncEngine, pairs: list[tuple[str, str]], room: int | None,
                         limiter: anyio.CapacityLimiter) -> tuple[list[list[int]], list[int | None]]:
    """A cross-encoder's inputs: each distinct text encoded once, however many pairs it is in,
    and each pair joined by the tokenizer's pair template; and where each one's second token type
    starts (Tokenizer.join_pair)."""
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    for text in texts:  # a text that alone fills the context makes every pair with it too long
        if room is None:
            check_prompt_chars(engine, len(text), "documents")
    ids: dict[str, list[int]] = {}
    for text in texts:
        with _as_400():
            ids[text] = await off_loop(limiter, engine.encode_prompt, text, False)
    inputs, types_from = [], []
    for first, second in pairs:
        with _as_400():
            joined, at = engine.join_pair(ids[first], ids[second], room)
            engine.validate_embedding(joined)
        inputs.append(joined)
        types_from.append(at)
    return inputs, types_from


async def _joined(engine: AsyncEngine, pairs: list[tuple[str, str]], room: int | None,
                  limiter: anyio.CapacityLimiter, template_kwargs: dict) -> list[list[int]]:
    """An LLM reranker's inputs, or any classifier's under --chat-template: each pair made one text
    (EngineClient.pair_as_text, vLLM's way), so each pair is tokenized whole; the characters a
    request may have tokenized so are bounded first."""
    chars = sum(len(first) + len(second) for first, second in pairs)
    if chars > MAX_JOINED_CHARS:
        raise bad_request(f"the request's pairs hold {chars} characters of text to tokenize (the query once for each "
                          f"document); at most {MAX_JOINED_CHARS} are taken at once", param="documents")
    inputs = []
    for first, second in pairs:
        if room is None:
            check_prompt_chars(engine, len(first) + len(second), "documents")
        with _as_400():
            inputs.append(await off_loop(limiter, engine.pair_as_text, first, second, room, template_kwargs))
            engine.validate_embedding(inputs[-1])
    return inputs


@contextmanager
def _as_400():
    """A RequestError from making or checking a pair's input, as the 400 saying why."""
    try:
        yield
    except RequestError as exc:
        raise bad_request(str(exc), param="documents" if exc.param in (None, "input") else exc.param,
                          code=exc.code) from None


def _texts(value, param: str) -> list[str]:
    """A text or a non-empty list of texts, each a non-empty string."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad_request(f"{param} must be a non-empty string or a non-empty list of non-empty strings",
                          param=param)
    return texts
