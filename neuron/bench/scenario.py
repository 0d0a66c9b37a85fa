"""`neuron bench --scenario FILE`: named load scenarios against one or more servers, each with
assertions on what it measured, and a report that says PASS or FAIL per scenario.

The file (YAML or JSON) names the servers ("providers") and the scenarios:

    providers:
      a: http://10.0.0.5:8000/v1
      b: http://10.0.0.6:8000/v1
    scenarios:
      - name: chat-burst
        providers: [a, b]        # requests go to them in turn (no balancer needed); default: all
        users: 32                # requests in flight at once
        requests: 256
        stream: true
        input_len: [64, 512]     # tokens, fixed or a range drawn per request
        output_len: 128
        request_rate: 20         # Poisson arrivals per second; default: all at once
        assert:
          p99_ttft_ms: 800
          error_rate: 0.01
          min_output_throughput: 500

Without `providers`, the `--base-url`s given on the command line are the providers. Each request's
latency is taken apart as a client sees it: queue (waiting for a free user slot), headers (sent
until the response's status arrived: connection, admission and, without streaming, the whole
generation), TTFT, decode (first token to last) and end to end. Assertions: `p99_<stage>_ms` and
`p50_<stage>_ms` bound a stage's percentile, `error_rate` the share of failed requests,
`min_output_throughput` and `min_request_throughput` what the scenario sustained.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

from neuron.bench.load import BenchConfig, RequestRecord, _client, _Runner, first_model, send_all
from neuron.bench.prompts import build_requests
from neuron.bench.report import describe
from neuron.errors import ConfigError

STAGES = ("queue", "headers", "ttft", "decode", "e2e")
_KEYS = {"name", "providers", "users", "requests", "stream", "input_len", "output_len", "request_rate", "endpoint",
         "ignore_eos", "timeout", "seed", "assert"}


@dataclass(slots=True)
class Scenario:
    name: str
    providers: list[str]  # base URLs
    users: int = 1
    requests: int = 16
    stream: bool = True
    input_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (128, 128)
    request_rate: float = math.inf
    endpoint: str = "completions"
    ignore_eos: bool = True
    timeout: float = 300.0
    seed: int = 0
    checks: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    scenario: Scenario
    records: list[RequestRecord]
    duration_s: float
    stages: dict[str, dict[str, float | None]]  # stage -> {"p50": ms, "p99": ms}
    error_rate: float
    output_throughput: float
    request_throughput: float
    verdicts: list[tuple[str, float | None, float, bool]]  # (check, observed, limit, passed)

    @property
    def passed(self) -> bool:
        return all(ok for *_, ok in self.verdicts)


def load_scenarios(path: str | Path, base_urls: list[str]) -> list[Scenario]:
    """The file's scenarios, each with its providers' URLs; ConfigError naming what is wrong."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--scenario {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("scenarios"), list) or not doc["scenarios"]:
        raise ConfigError(f"--scenario {path}: needs a list of scenarios")
    providers = doc.get("providers") or {f"url{i}": u for i, u in enumerate(base_urls)}
    if not isinstance(providers, dict) or not providers:
        raise ConfigError(f"--scenario {path}: name the servers under providers, or pass --base-url")
    return [_scenario(item, providers, i) for i, item in enumerate(doc["scenarios"])]


def _scenario(item: Any, providers: dict[str, str], index: int) -> Scenario:
    where = f"scenario {index + 1}"
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: must be a mapping")
    where = f"scenario {item.get('name', index + 1)!r}"
    unknown = sorted(set(item) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    names = item.get("providers", list(providers))
    missing = [n for n in names if n not in providers]
    if missing:
        raise ConfigError(f"{where}: no provider named {', '.join(map(str, missing))}")
    checks = item.get("assert") or {}
    for key, limit in checks.items():
        if not _known_check(key) or not isinstance(limit, (int, float)):
            raise ConfigError(f"{where}: assertion {key}: {limit!r} is not one neuron checks")
    try:
        return Scenario(
            name=str(item.get("name", index + 1)), providers=[providers[n].rstrip("/") for n in names],
            users=int(item.get("users", 1)), requests=int(item.get("requests", 16)),
            stream=bool(item.get("stream", True)), input_len=_span(item.get("input_len", 128)),
            output_len=_span(item.get("output_len", 128)),
            request_rate=float(item.get("request_rate", math.inf)), endpoint=str(item.get("endpoint", "completions")),
            ignore_eos=bool(item.get("ignore_eos", True)), timeout=float(item.get("timeout", 300.0)),
            seed=int(item.get("seed", 0)), checks={k: float(v) for k, v in checks.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _span(value: Any) -> tuple[int, int]:
    if isinstance(value, list) and len(value) == 2:
        return int(value[0]), int(value[1])
    return int(value), int(value)


def _known_check(key: str) -> bool:
    if key in ("error_rate", "min_output_throughput", "min_request_throughput"):
        return True
    pct, _, rest = key.partition("_")
    return pct in ("p50", "p99") and rest.endswith("_ms") and rest[:-3] in STAGES


async def run_scenario(s: Scenario) -> Outcome:
    """Send the scenario's requests to its providers in turn, `users` at a time."""
    configs = [BenchConfig(url, num_requests=s.requests, concurrency=s.users, request_rate=s.request_rate,
                           endpoint=s.endpoint, input_len=s.input_len, output_len=s.output_len, seed=s.seed,
                           ignore_eos=s.ignore_eos, timeout=s.timeout, stream=s.stream) for url in s.providers]
    requests = build_requests(s.requests, seed=s.seed, input_len=s.input_len, output_len=s.output_len,
                              token_ids=configs[0].token_id_prompts)
    records: list[RequestRecord] = []
    async with _client(configs[0]) as client:
        runners = [_Runner(client, c, await first_model(client, c.base_url)) for c in configs]

        def send(i: int, req, t0: float):  # the providers in turn
            return runners[i % len(runners)].send(i, req, t0)

        t0 = perf_counter()
        await send_all(requests, send, records, t0, users=s.users, rate=s.request_rate, seed=s.seed)
        duration = perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return _outcome(s, records, duration)


def _outcome(s: Scenario, records: list[RequestRecord], duration: float) -> Outcome:
    ok = [r for r in records if r.ok]
    values = {
        "queue": [r.queue_s for r in records],
        "headers": [r.headers_s for r in ok if r.headers_s is not None],
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "decode": [r.e2e_s - r.ttft_s for r in ok if r.ttft_s is not None],
        "e2e": [r.e2e_s for r in ok],
    }
    stages = {}
    for k, v in values.items():
        st = describe([x * 1e3 for x in v])
        stages[k] = {"p50": st.p50, "p99": st.p99}
    error_rate = 1 - len(ok) / len(records) if records else 1.0
    out_tps = sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0
    req_tps = len(ok) / duration if duration > 0 else 0.0
    verdicts = []
    for key, limit in s.checks.items():
        if key == "error_rate":
            verdicts.append((key, error_rate, limit, error_rate <= limit))
        elif key == "min_output_throughput":
            verdicts.append((key, out_tps, limit, out_tps >= limit))
        elif key == "min_request_throughput":
            verdicts.append((key, req_tps, limit, req_tps >= limit))
        else:
            pct, _, rest = key.partition("_")
            observed = stages[rest[:-3]][pct]
            verdicts.append((key, observed, limit, observed is not None and observed <= limit))
    return Outcome(s, records, duration, stages, error_rate, out_tps, req_tps, verdicts)


def format_report(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        s = o.scenario
        ok = sum(r.ok for r in o.records)
        lines += [f"== {s.name}: {'PASS' if o.passed else 'FAIL'}",
                  f"   {len(s.providers)} provider(s), {s.users} user(s), {s.requests} requests, "
                  f"{'streaming' if s.stream else 'not streaming'}; {ok} ok, {len(o.records) - ok} failed "
                  f"in {o.duration_s:.2f} s; {o.request_throughput:.2f} req/s, {o.output_throughput:.1f} output tok/s",
                  "   latency (ms)  " + "".join(f"{st:>10}" for st in STAGES)]
        for pct in ("p50", "p99"):
            lines.append(f"   {pct:<13}" + "".join(f"{_ms(o.stages[st][pct]):>10}" for st in STAGES))
        for key, observed, limit, passed in o.verdicts:
            bound = ">=" if key.startswith("min_") else "<="
            seen = "-" if observed is None else f"{observed:.4g}"
            lines.append(f"   {'PASS' if passed else 'FAIL'}  {key} = {seen} (want {bound} {limit:g})")
    failed = [o.scenario.name for o in outcomes if not o.passed]
    lines.append(f"{len(outcomes)} scenario(s): {len(outcomes) - len(failed)} passed, {len(failed)} failed"
                 + (f" ({', '.join(failed)})" if failed else ""))
    return "\n".join(lines)


def to_json(outcomes: list[Outcome]) -> str:
    return json.dumps([{"name": o.scenario.name, "passed": o.passed, "duration_s": o.duration_s,
                        "stages_ms": o.stages, "error_rate": o.error_rate,
                        "output_throughput": o.output_throughput, "request_throughput": o.request_throughput,
                        "assertions": [{"check": k, "observed": v, "limit": lim, "passed": ok}
                                       for k, v, lim, ok in o.verdicts]} for o in outcomes], indent=2)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
