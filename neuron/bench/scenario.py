"""`neuron bench --scenario FILE`: named load scenarios against one or more servers, each with
assertions on what it measured, and a report that says PASS or FAIL per scenario.

The file (YAML or JSON) names the servers ("providers") and the scenarios; docs/bench_scenarios.yaml
shows every key with its range and default (tests/test_bench.py reads and runs it). Without
`providers`, the `--base-url`s given on the command line are the providers. Each request's latency
is taken apart as a client sees it: queue (waiting for a free user slot), headers (sent until the
response's status arrived: connection, admission and, without streaming, the whole generation),
TTFT, decode (first token to last) and end to end. Assertions: `p99_<stage>_ms` and
`p50_<stage>_ms` bound a stage's percentile, `error_rate` the share of failed requests,
`min_output_throughput` and `min_request_throughput` what the scenario sustained.

The file is checked whole before anything is built or sent, every number against a range (the
prompts are built up front, so `requests: 1e12` would otherwise take the machine's memory first),
and read without YAML aliases, deeper nesting than MAX_NESTING or more than MAX_NODES values: a
malformed file gets one line naming the file, the scenario, the key and what it takes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from time import perf_counter
from typing import Any

from neuron.bench.load import (
    ENDPOINTS,
    MAX_CONCURRENCY,
    MAX_PROMPT_TOKENS,
    MAX_REQUESTS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    BenchConfig,
    RequestRecord,
    _client,
    _Runner,
    first_model,
    send_all,
)
from neuron.bench.prompts import build_requests
from neuron.bench.report import describe
from neuron.errors import ConfigError
from neuron.utils import safe_yaml

STAGES = ("queue", "headers", "ttft", "decode", "e2e")
# A scenario file is small; past these it is refused before it is parsed further.
MAX_FILE_BYTES = 64 * 1024
MAX_NODES = 10_000  # mappings, lists and values (about 15 a scenario)
MAX_NESTING = 16  # levels of mappings and lists (the parser recurses per level)


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
    """The file's scenarios, each with its providers' URLs; a one-line ConfigError naming the
    file, the scenario and the key where anything is wrong, before anything is built or sent."""
    doc = _read(Path(path))
    try:
        return _scenarios(doc, base_urls)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _read(path: Path) -> Any:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read --scenario {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB; a scenario file is YAML or JSON "
                          "naming providers and scenarios")
    return safe_yaml.load(data, f"{path}: not a scenario file", MAX_NESTING, MAX_NODES)


def _scenarios(doc: Any, base_urls: list[str]) -> list[Scenario]:
    if not isinstance(doc, dict):
        raise ConfigError("a scenario file is a mapping with scenarios (a list) and providers (optional)")
    unknown = sorted(map(str, set(doc) - {"providers", "scenarios"}))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} (known: providers, scenarios)")
    if not isinstance(doc.get("scenarios"), list) or not doc["scenarios"]:
        raise ConfigError("needs a list of scenarios")
    providers = _providers(doc.get("providers") or {f"url{i}": u for i, u in enumerate(base_urls)})
    return [_scenario(item, providers, i) for i, item in enumerate(doc["scenarios"])]


def _providers(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not value:
        raise ConfigError("name the servers under providers (name: URL), or pass --base-url")
    for name, url in value.items():
        if not isinstance(name, str) or not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"providers: {_shown(name)} must name an http:// or https:// URL, got {_shown(url)}")
    return value


def _scenario(item: Any, providers: dict[str, str], index: int) -> Scenario:
    if not isinstance(item, dict):
        raise ConfigError(f"scenario {index + 1}: must be a mapping of keys ({', '.join(_RULES)}), "
                          f"got {_shown(item)}")
    name = item.get("name", str(index + 1))
    if not isinstance(name, (str, int)) or isinstance(name, bool) or not 1 <= len(str(name)) <= 100:
        raise ConfigError(f"scenario {index + 1}: name must be a string of 1 to 100 characters, got {_shown(name)}")
    where = f"scenario {str(name)!r}"
    unknown = sorted(map(str, set(item) - set(_RULES)))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(_RULES)})")
    values = {}
    for key, value in item.items():
        parse, allowed = _RULES[key]
        try:
            values[key] = parse(value, providers)
        except (TypeError, ValueError) as exc:
            detail = f": {exc}" if str(exc) else f" must be {allowed}, got {_shown(value)}"
            raise ConfigError(f"{where}: {key}{detail}") from None
    _check_prompt_tokens(where, values)
    names = values.get("providers", list(providers))
    return Scenario(name=str(name), providers=[providers[n].rstrip("/") for n in names],
                    **{_FIELD.get(k, k): v for k, v in values.items() if k not in ("name", "providers")})


def _check_prompt_tokens(where: str, values: dict[str, Any]) -> None:
    """Every prompt is built before the first request is sent: their tokens together are bounded."""
    defaults = {f.name: f.default for f in fields(Scenario)}
    requests = values.get("requests", defaults["requests"])
    longest = values.get("input_len", defaults["input_len"])[1]
    if requests * longest > MAX_PROMPT_TOKENS:
        raise ConfigError(f"{where}: requests x input_len ({requests:,} x {longest:,} tokens) must be at most "
                          f"{MAX_PROMPT_TOKENS:,} prompt tokens, which are built before the run; lower either")


def _integer(lo: int, hi: int):
    def parse(value: Any, _providers=None) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi or value % 1:
            raise ValueError
        return int(value)

    return parse, f"an integer in {lo:,}..{hi:,}"


def _number(lo: float, hi: float, what: str):
    def parse(value: Any, _providers=None) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < value <= hi:
            raise ValueError
        return float(value)

    return parse, what


def _span(value: Any, _providers=None) -> tuple[int, int]:
    lo, hi = value if isinstance(value, list) and len(value) == 2 else (value, value)
    lo, hi = _tokens(lo), _tokens(hi)
    if lo > hi:
        raise ValueError
    return lo, hi


def _flag(value: Any, _providers=None) -> bool:
    if not isinstance(value, bool):
        raise ValueError
    return value


def _names(value: Any, providers: dict[str, str]) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(n, str) and n in providers for n in value):
        raise ValueError
    return value


def _one_of(*choices: str):
    def parse(value: Any, _providers=None) -> str:
        if value not in choices:
            raise ValueError
        return value

    return parse, " or ".join(choices)


def _checks(value: Any, _providers=None) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ValueError
    for key, limit in value.items():
        if not _known_check(key):
            raise ValueError(f"{_shown(key)} is not a check neuron makes ({_CHECKS})")
        top = 1.0 if key == "error_rate" else math.inf
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= limit <= top:
            allowed = "in 0..1" if key == "error_rate" else "at least 0"
            raise ValueError(f"{key} must be a number {allowed}, got {_shown(limit)}")
    return {k: float(v) for k, v in value.items()}


def _known_check(key: Any) -> bool:
    if key in ("error_rate", "min_output_throughput", "min_request_throughput"):
        return True
    pct, _, rest = str(key).partition("_")
    return pct in ("p50", "p99") and rest.endswith("_ms") and rest[:-3] in STAGES


_tokens = _integer(1, MAX_TOKENS)[0]
_CHECKS = (f"p50_<stage>_ms and p99_<stage>_ms for a stage among {', '.join(STAGES)}; error_rate; "
           "min_output_throughput; min_request_throughput")
_LENGTH = f"tokens, an integer or a range [A, B] with 1 <= A <= B <= {MAX_TOKENS:,}"
# Each key: how it is read (a ValueError or TypeError refuses it, its message said where it has
# one), and what it takes, for the refusal.
_RULES = {
    "name": (lambda value, _: value, "a string"),
    "providers": (_names, "a non-empty list of names under providers"),
    "users": _integer(1, MAX_CONCURRENCY),
    "requests": _integer(1, MAX_REQUESTS),
    "stream": (_flag, "true or false"),
    "input_len": (_span, _LENGTH),
    "output_len": (_span, _LENGTH),
    "request_rate": _number(0, math.inf, "a positive number of requests per second (.inf: all at once)"),
    "endpoint": _one_of(*ENDPOINTS),
    "ignore_eos": (_flag, "true or false"),
    "timeout": _number(0, MAX_TIMEOUT_S, f"a number of seconds, more than 0 and at most {MAX_TIMEOUT_S:,g}"),
    "seed": _integer(0, 2**63 - 1),
    "assert": (_checks, f"a mapping of checks ({_CHECKS}) to numbers"),
}
_FIELD = {"assert": "checks"}  # the Scenario field a key fills, where its name differs


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
