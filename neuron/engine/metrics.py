"""Prometheus metrics, in a registry of the server's own so two servers in one process never collide.

The server's series (HTTP requests by endpoint and status) are `Metrics`'; every engine series
carries a `model` label, and each model's engine writes through its own `ModelMetrics`
(`Metrics.for_model(name)`), so the models a server hosts are told apart in one scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STATES = ("loading", "ready", "recovering", "failed", "shutting_down")
MODEL = ["model"]


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("neuron_requests", "HTTP API requests by endpoint and response status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("neuron_request_finished", "Generations by finish reason", MODEL + ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("neuron_prompt_tokens", "Prompt tokens of admitted requests", MODEL, registry=r)
        self.recoveries = Counter("neuron_recoveries", "Times the ranks failed and were rebuilt", MODEL, registry=r)
        self.generation_tokens = Counter("neuron_generation_tokens", "Generated tokens", MODEL, registry=r)
        self.ttft = Histogram("neuron_time_to_first_token_seconds", "Arrival to first generated token", MODEL,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("neuron_inter_token_latency_seconds", "Time between consecutive generated tokens", MODEL,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("neuron_e2e_request_latency_seconds", "Arrival to last token", MODEL,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("neuron_num_requests_running", "Sequences holding a KV slot", MODEL, registry=r)
        self.waiting = Gauge("neuron_num_requests_waiting", "Sequences waiting for a KV slot", MODEL, registry=r)
        self.kv_usage = Gauge("neuron_kv_slot_usage_ratio", "Fraction of KV slots in use (0..1)", MODEL, registry=r)
        self.state = Enum("neuron_engine_state", "Engine lifecycle state", MODEL, states=list(STATES), registry=r)
        self.kv_cache_usage = Gauge("neuron_kv_cache_usage_ratio", "Fraction of KV-cache blocks held by sequences "
                                    "(0..1)", MODEL, registry=r)
        self.prefix_queries = Counter("neuron_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      MODEL, registry=r)
        self.prefix_hits = Counter("neuron_prefix_cache_hits", "Prompt tokens found in the prefix cache (prefill "
                                   "skipped)", MODEL, registry=r)
        self.prefix_hit_rate = Gauge("neuron_prefix_cache_hit_rate", "Prefix-cache hits over queries since start, "
                                     "in tokens (0..1)", MODEL, registry=r)
        self.spec_proposed = Counter("neuron_spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding",
                                     MODEL, registry=r)
        self.spec_accepted = Counter("neuron_spec_decode_num_accepted_tokens", "Proposed tokens the target kept",
                                     MODEL, registry=r)
        self.spec_drafts = Counter("neuron_spec_decode_num_drafts", "Sequence-steps that carried a proposal", MODEL,
                                   registry=r)
        self.spec_acceptance = Gauge("neuron_spec_decode_acceptance_rate", "Accepted over proposed tokens since start "
                                     "(0..1)", MODEL, registry=r)
        self.spec_mean_length = Gauge("neuron_spec_decode_mean_accepted_length", "Tokens a speculative sequence-step "
                                      "produced on average since start (accepted + 1)", MODEL, registry=r)

    def for_model(self, name: str) -> ModelMetrics:
        """The series of model `name`, which its engine writes."""
        return ModelMetrics(self, name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's engine series: the server's metrics, labelled with the model's name."""

    def __init__(self, server: Metrics, name: str):
        self.server = server
        self.name = name
        for attr in ("prompt_tokens", "recoveries", "generation_tokens", "ttft", "itl", "e2e", "running", "waiting",
                     "kv_usage", "state", "kv_cache_usage", "prefix_queries", "prefix_hits", "prefix_hit_rate",
                     "spec_proposed", "spec_accepted", "spec_drafts", "spec_acceptance", "spec_mean_length"):
            setattr(self, attr, getattr(server, attr).labels(model=name))
        self.state.state("loading")
        self._prefix_seen = (0, 0)
        self._spec_seen = (0, 0, 0)

    def finished_with(self, reason: str) -> None:
        self.server.finished.labels(model=self.name, reason=reason).inc()

    def engine_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def kv_cache(self, usage: float, queries: int, hits: int) -> None:
        """The engine's block usage and its cumulative prefix-cache counts (engine.prefix_cache_counts())."""
        self.kv_cache_usage.set(usage)
        self._prefix_seen = _mirror((self.prefix_queries, self.prefix_hits), (queries, hits), self._prefix_seen)
        if queries:
            self.prefix_hit_rate.set(hits / queries)

    def speculative(self, proposed: int, accepted: int, drafts: int) -> None:
        """The engine's cumulative speculative counts (spec_decode's Counts)."""
        self._spec_seen = _mirror((self.spec_proposed, self.spec_accepted, self.spec_drafts),
                                  (proposed, accepted, drafts), self._spec_seen)
        if proposed:
            self.spec_acceptance.set(accepted / proposed)
        if drafts:
            self.spec_mean_length.set(accepted / drafts + 1)

    def forget(self) -> None:
        """The model is gone (unloaded): its gauges leave the scrape; its counters stay, as counters do."""
        for gauge in ("running", "waiting", "kv_usage", "kv_cache_usage", "prefix_hit_rate", "spec_acceptance",
                      "spec_mean_length", "state"):
            try:
                getattr(self.server, gauge).remove(self.name)
            except KeyError:
                pass


def _mirror(counters: tuple, now: tuple[int, ...], seen: tuple[int, ...]) -> tuple[int, ...]:
    """Advance Prometheus counters by what an engine's cumulative counts gained since `seen` (a
    rebuilt engine starts again from zero, which adds nothing); the counts to remember."""
    for counter, value, before in zip(counters, now, seen):
        counter.inc(max(0, value - before))
    return now
