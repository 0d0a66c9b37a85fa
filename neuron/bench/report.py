"""What a benchmark measured: summary statistics, a printed table, JSON, and an optional plot."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from neuron.errors import ConfigError

if TYPE_CHECKING:
    from neuron.bench.load import BenchResult, RequestRecord

METRICS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}
MATPLOTLIB_MISSING = "plots need matplotlib, which is not installed: pip install matplotlib"


@dataclass(slots=True)
class Stats:
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(slots=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input and output tokens per second
    input_tokens: int
    output_tokens: int
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    errors: dict[str, int]  # error text -> how many requests failed with it


def describe(values: Sequence[float]) -> Stats:
    """Mean and percentiles (linear interpolation between closest ranks); all None without data."""
    if len(values) == 0:
        return Stats(None, None, None, None)
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = (float(v) for v in np.percentile(a, [50, 90, 99]))
    return Stats(float(a.mean()), p50, p90, p99)


def latencies_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Every sample of each latency metric over the completed requests, in milliseconds."""
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": [r.ttft_s * 1e3 for r in ok],
        "tpot_ms": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
        "itl_ms": [g * 1e3 for r in ok for g in r.itl_s],
        "e2e_ms": [r.e2e_s * 1e3 for r in ok],
    }


def summarize(records: Sequence[RequestRecord], duration_s: float) -> Summary:
    ok = [r for r in records if r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    stats = {k: describe(v) for k, v in latencies_ms(records).items()}
    errors = dict(Counter(r.error for r in records if not r.ok).most_common())
    return Summary(len(ok), len(records) - len(ok), duration_s, len(ok) * per_s, n_out * per_s,
                   (n_in + n_out) * per_s, n_in, n_out, errors=errors, **stats)


def result_summary(result: BenchResult) -> Summary:
    return summarize(result.records, result.duration_s)


def format_table(result: BenchResult, summary: Summary | None = None) -> str:
    s = summary or result_summary(result)
    cfg = result.config
    arrivals = "all at once" if math.isinf(cfg.request_rate) else f"Poisson at {cfg.request_rate:g} req/s"
    rows = [
        ("Model", result.model),
        ("Endpoint", f"{cfg.base_url} ({cfg.endpoint})"),
        ("Load", f"concurrency {cfg.concurrency or 'unlimited'}, arrivals {arrivals}"),
        ("Completed / failed", f"{s.completed} / {s.failed}" + ("  (interrupted)" if result.interrupted else "")),
        ("Duration (s)", f"{s.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
        ("Input / output tokens", f"{s.input_tokens} / {s.output_tokens}"),
    ]
    if (spec := result.speculation) is not None:
        rows += [("Speculative acceptance", f"{spec['acceptance_rate']:.1%} ({spec['accepted_tokens']:.0f} of "
                                            f"{spec['draft_tokens']:.0f} proposed tokens)"),
                 ("Mean accepted length", f"{spec['mean_accepted_length']:.2f} tokens per speculative step")]
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{k:<{width}}{v}" for k, v in rows]
    lines += ["", f"{'Latency (ms)':<14}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p99"))]
    for key, label in METRICS.items():
        st: Stats = getattr(s, key)
        lines.append(f"{label:<14}" + "".join(f"{_ms(v):>10}" for v in (st.mean, st.p50, st.p90, st.p99)))
    if s.errors:
        lines += ["", "Errors"] + [f"{n:>6} x {text}" for text, n in s.errors.items()]
    rule = "=" * max(len(ln) for ln in lines)
    return "\n".join([rule, *lines, rule])


def to_json(result: BenchResult, summary: Summary | None = None) -> bytes:
    """The summary, the settings and every request's raw timings, indented."""
    requests = [asdict(r) | {"tpot_s": r.tpot_s} for r in result.records]
    doc = {"model": result.model, "interrupted": result.interrupted, "config": result.config.to_dict(),
           "summary": summary or result_summary(result), "speculation": result.speculation, "requests": requests}
    return msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n"


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(MATPLOTLIB_MISSING) from None


def write_plot(result: BenchResult, path: str | Path) -> None:
    """A PNG with one panel per latency metric: a histogram and its cumulative distribution."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    fig.suptitle(f"{result.model}: {len([r for r in result.records if r.ok])} requests")
    for ax, (key, values) in zip(fig.subplots(2, 2).flat, latencies_ms(result.records).items()):
        ax.set_title(METRICS[key])
        ax.set_xlabel("ms")
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=50, color="tab:blue", alpha=0.6)
        ax.set_ylabel("requests" if key != "itl_ms" else "chunks")
        cdf = ax.twinx()
        xs = np.sort(values)
        cdf.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color="tab:orange")
        cdf.set_ylim(0, 1.02)
        cdf.set_ylabel("cumulative fraction")
        st = describe(values)
        for name, q, style in (("p50", st.p50, "--"), ("p99", st.p99, ":")):
            ax.axvline(q, color="black", linestyle=style, linewidth=1, label=f"{name} {q:.1f} ms")
        ax.legend(loc="center right")
    fig.savefig(path, format="png", dpi=100)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
