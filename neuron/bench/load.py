"""The load generator: streams requests to an OpenAI-compatible endpoint and times every chunk.

Requests go out at a fixed concurrency or as Poisson arrivals at a given rate (both may be set:
arrivals then wait for a free slot). Every request streams with `include_usage`, so output token
counts come from the server when it reports them and from the number of content chunks otherwise.
Inter-token latency is measured between content chunks, as a client sees it. A chunk carrying
logprobs counts as content even without text: a server whose checkpoint has no tokenizer streams
no text, so only `logprobs` (0 is enough) makes it send one chunk per token.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from time import perf_counter
from typing import Any

import anyio
import httpx
import msgspec

from neuron.bench.prompts import BenchRequest, build_requests
from neuron.errors import ConfigError, NeuronError

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}
# What one run may ask for, checked before anything is built: every prompt is made before the first
# request is sent (a token id in a list takes about 36 bytes), and each request in flight holds a
# connection.
MAX_REQUESTS = 1_000_000
MAX_CONCURRENCY = 10_000
MAX_TOKENS = 2**20  # a prompt's, an output's
MAX_PROMPT_TOKENS = 2**24  # all prompts' together: about 600 MB of token ids
MAX_TIMEOUT_S = 86_400.0


class BenchError(NeuronError):
    """The benchmark could not start: the server is unreachable or does not list a model."""


@dataclass(slots=True)
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    num_requests: int = 100
    concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at once
    endpoint: str = "completions"
    input_len: tuple[int, int] = (128, 128)  # inclusive range, drawn per request
    output_len: tuple[int, int] = (128, 128)
    prompts_file: str | None = None  # JSONL: {"prompt": ..., "max_tokens": optional}
    text_prompts: bool = False  # completions only; chat always sends text
    seed: int = 0
    ignore_eos: bool = False
    timeout: float = 300.0  # seconds, per request, first byte to last
    warmup: int = 0  # requests sent and discarded before timing starts
    progress: bool = False  # a progress bar on stderr
    logprobs: int | None = None  # per output token; None: not asked for
    stream: bool = True  # False: one JSON response per request (no TTFT or inter-token latency)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ConfigError(f"num_requests must be in 1..{MAX_REQUESTS:,}, got {self.num_requests:,}")
        if self.concurrency is not None and not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ConfigError(f"concurrency must be in 1..{MAX_CONCURRENCY:,}, got {self.concurrency:,}")
        if not self.request_rate > 0:
            raise ConfigError("request_rate must be positive (inf sends everything at once)")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi <= MAX_TOKENS:
                raise ConfigError(f"{name} must be a range A:B with 1 <= A <= B <= {MAX_TOKENS:,}, got {lo}:{hi}")
        if self.prompts_file is None and self.num_requests * self.input_len[1] > MAX_PROMPT_TOKENS:
            raise ConfigError(f"num_requests x input_len must be at most {MAX_PROMPT_TOKENS:,} prompt tokens, "
                              f"which are built before the run; got {self.num_requests:,} x {self.input_len[1]:,}")
        if not 0 < self.timeout <= MAX_TIMEOUT_S:
            raise ConfigError(f"timeout must be more than 0 and at most {MAX_TIMEOUT_S:,g} seconds")
        if not 0 <= self.warmup <= MAX_REQUESTS:
            raise ConfigError(f"warmup must be in 0..{MAX_REQUESTS:,}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ConfigError("logprobs must be 0 or more")

    @property
    def token_id_prompts(self) -> bool:
        return self.endpoint == "completions" and not self.text_prompts

    def to_dict(self) -> dict[str, Any]:
        """The settings, without the API key, fit for a report."""
        d = asdict(self)
        del d["api_key"], d["progress"]
        d["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return d


@dataclass(slots=True)
class RequestRecord:
    index: int
    start_s: float  # when it was sent, since timing started
    prompt_tokens: int
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    e2e_s: float | None = None
    output_tokens: int = 0
    headers_s: float | None = None  # sent until the response's status and headers arrived
    queue_s: float = 0.0  # waiting for a free user slot before being sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class BenchResult:
    config: BenchConfig
    model: str
    records: list[RequestRecord]  # finished requests, in the order they were sent
    duration_s: float
    interrupted: bool = False  # stopped early; requests still in flight are not in `records`
    speculation: dict[str, float] | None = None  # the server's speculative decoding over the run, if it speculated


class _Failed(Exception):
    pass


async def run_benchmark(config: BenchConfig, stop: anyio.Event | None = None) -> BenchResult:
    """Run the load described by `config`; setting `stop` ends it early with what has finished."""
    requests = build_requests(config.num_requests, seed=config.seed, input_len=config.input_len,
                              output_len=config.output_len, token_ids=config.token_id_prompts,
                              prompts_file=config.prompts_file)
    if config.endpoint == "chat" and any(isinstance(r.prompt, list) for r in requests):
        raise ConfigError("the chat endpoint takes text prompts; token-id prompts need --endpoint completions")
    async with _client(config) as client:
        model = config.model or await first_model(client, config.base_url)
        runner = _Runner(client, config, model)
        result = BenchResult(config, model, [], 0.0)
        async with anyio.create_task_group() as tg:
            if stop is not None:
                tg.start_soon(_cancel_when_set, stop, tg.cancel_scope)
            if config.warmup:
                warm = [requests[i % len(requests)] for i in range(config.warmup)]
                await runner.run(warm, [], perf_counter(), paced=False)
            counts = await spec_counts(client, config.base_url)
            t0 = perf_counter()
            try:
                await runner.run(requests, result.records, t0, progress=config.progress)
            finally:
                result.duration_s = perf_counter() - t0
            after = await spec_counts(client, config.base_url)
            result.speculation = spec_summary(counts, after)
            tg.cancel_scope.cancel()
    result.interrupted = stop is not None and stop.is_set()
    result.records.sort(key=lambda r: r.index)
    return result


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    url = f"{base_url}/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except httpx.ConnectError as e:  # nothing listens there: --model would not help
        message = f"cannot connect to {base_url} ({e}); is the server running, and is --base-url right?"
        raise BenchError(message) from None
    except (httpx.HTTPError, ValueError, LookupError, TypeError) as e:
        raise BenchError(f"cannot read a model name from {url} ({type(e).__name__}: {e}); pass --model") from None


# speculative decoding's Prometheus counters: neuron's, and vLLM's names for a vLLM server
SPEC_COUNTERS = {"drafts": ("neuron_spec_decode_num_drafts", "vllm:spec_decode_num_drafts"),
                 "draft_tokens": ("neuron_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
                 "accepted_tokens": ("neuron_spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens")}


async def spec_counts(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its /metrics (beside the API's /v1), summed
    over their labels; None where it has none or does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        resp = await client.get(f"{root}/metrics", timeout=10.0)
        resp.raise_for_status()
        families = list(text_string_to_metric_families(resp.text))
    except (httpx.HTTPError, ValueError):
        return None
    totals: dict[str, float] = {}
    for sample in (sample for fam in families for sample in fam.samples):
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    counts = {}
    for key, names in SPEC_COUNTERS.items():
        found = [totals[f"{n}_total"] for n in names if f"{n}_total" in totals]
        if not found:
            return None
        counts[key] = found[0]
    return counts


def spec_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What the server proposed and kept between two readings; None where it did not speculate."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in after}
    if d["drafts"] <= 0 or d["draft_tokens"] <= 0:
        return None
    return d | {"acceptance_rate": d["accepted_tokens"] / d["draft_tokens"],
                "mean_accepted_length": 1 + d["accepted_tokens"] / d["drafts"]}


def _client(config: BenchConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    slots = config.concurrency or max(config.num_requests, config.warmup)
    limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(config.timeout), limits=limits)


async def _cancel_when_set(stop: anyio.Event, scope: anyio.CancelScope) -> None:
    await stop.wait()
    scope.cancel()


async def send_all(requests: list[BenchRequest], send, records: list[RequestRecord], t0: float, *, users: int,
                   rate: float, seed: int, bar=None) -> None:
    """`send(i, requests[i], t0)` for every request, `users` at a time, arriving as a Poisson process
    at `rate` per second (all at once when infinite); each record learns how long it queued for a
    free user before being sent."""
    limiter = anyio.CapacityLimiter(users)
    arrivals = random.Random(seed)

    async def one(index: int, req: BenchRequest) -> None:
        queued = perf_counter()
        async with limiter:
            rec = await send(index, req, t0)
        rec.queue_s = rec.start_s - (queued - t0)
        records.append(rec)
        if bar is not None:
            bar.update()

    next_at = 0.0
    async with anyio.create_task_group() as tg:
        for i, req in enumerate(requests):
            if not math.isinf(rate):
                await anyio.sleep(max(0.0, t0 + next_at - perf_counter()))
                next_at += arrivals.expovariate(rate)
            tg.start_soon(one, i, req)


class _Runner:
    def __init__(self, client: httpx.AsyncClient, config: BenchConfig, model: str):
        self.client, self.config, self.model = client, config, model
        self.url = config.base_url + ENDPOINTS[config.endpoint]
        self.chat = config.endpoint == "chat"

    async def run(self, requests: list[BenchRequest], records: list[RequestRecord], t0: float,
                  paced: bool = True, progress: bool = False) -> None:
        cfg = self.config
        bar = _progress_bar(len(requests)) if progress else None
        try:
            await send_all(requests, self.send, records, t0, users=cfg.concurrency or len(requests),
                           rate=cfg.request_rate if paced else math.inf, seed=cfg.seed, bar=bar)
        finally:
            if bar is not None:
                bar.close()

    async def send(self, index: int, req: BenchRequest, t0: float) -> RequestRecord:
        start = perf_counter()
        rec = RequestRecord(index, start - t0, req.prompt_len)
        chunks: list[float] = []
        try:
            with anyio.fail_after(self.config.timeout):
                if self.config.stream:
                    await self._stream(self._body(req), rec, chunks)
                else:
                    await self._whole(self._body(req), rec, start)
            if not chunks and (self.config.stream or not rec.output_tokens):
                raise _Failed(_no_output(rec.output_tokens, self.config.logprobs))
            rec.ok = True
        except (TimeoutError, httpx.TimeoutException):
            rec.error = f"timed out after {self.config.timeout:g} s"
        except _Failed as e:
            rec.error = str(e)
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"
        except msgspec.DecodeError as e:
            rec.error = f"malformed stream data: {e}"
        end = perf_counter()
        rec.e2e_s = end - start
        if chunks:
            rec.ttft_s = chunks[0] - start
            rec.itl_s = [b - a for a, b in zip(chunks, chunks[1:])]
            rec.output_tokens = rec.output_tokens or len(chunks)
        return rec

    def _body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens, "stream": self.config.stream}
        if self.config.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if self.config.logprobs is not None and self.chat:
            body.update(logprobs=True, top_logprobs=self.config.logprobs)
        elif self.config.logprobs is not None:
            body["logprobs"] = self.config.logprobs
        return body

    async def _whole(self, body: dict[str, Any], rec: RequestRecord, start: float) -> None:
        resp = await self.client.post(self.url, json=body)
        rec.headers_s = perf_counter() - start  # the body came with them
        if resp.status_code != 200:
            raise _Failed(f"HTTP {resp.status_code}: {_shorten(resp.text)}")
        doc = msgspec.json.decode(resp.content)
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if not isinstance(usage, dict) or not usage.get("completion_tokens"):
            raise _Failed(f"no usage in the response: {_shorten(resp.text)}")
        rec.output_tokens = usage["completion_tokens"]
        rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens

    async def _stream(self, body: dict[str, Any], rec: RequestRecord, chunks: list[float]) -> None:
        start = perf_counter()
        async with self.client.stream("POST", self.url, json=body) as resp:
            rec.headers_s = perf_counter() - start
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise _Failed(f"HTTP {resp.status_code}: {_shorten(text)}")
            async for data in sse_data(resp):
                if data == "[DONE]":
                    break
                chunk = msgspec.json.decode(data)
                if not isinstance(chunk, dict):
                    raise _Failed(f"unexpected stream data: {_shorten(data)}")
                if "error" in chunk:
                    raise _Failed(f"server error: {_error_text(chunk['error'])}")
                if _content(chunk, self.chat):
                    chunks.append(perf_counter())
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    rec.output_tokens = usage.get("completion_tokens") or rec.output_tokens
                    rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each server-sent event; a multi-line data field is joined with newlines."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)


def _content(chunk: dict[str, Any], chat: bool) -> bool:
    """Whether the chunk carries output: text, or the logprobs of at least one token."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    logprobs = choices[0].get("logprobs")
    if isinstance(logprobs, dict) and (logprobs.get("content") if chat else logprobs.get("tokens")):
        return True
    if not chat:
        return bool(choices[0].get("text"))
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


def _no_output(reported_tokens: int, logprobs: int | None) -> str:
    if reported_tokens and logprobs is None:
        return (f"the server generated {reported_tokens} tokens but streamed no text (a checkpoint without a "
                "tokenizer?); pass --logprobs 0 so that each token arrives in its own chunk")
    return "the stream ended without any output"


def _error_text(error: Any) -> str:
    return _shorten(str(error.get("message", error) if isinstance(error, dict) else error))


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
