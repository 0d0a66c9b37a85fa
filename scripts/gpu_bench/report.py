"""The rows of the report, the ratios between them, and the markdown table."""

from __future__ import annotations

from dataclasses import dataclass, field

LIMIT, HF_EAGER, HF_STATIC, NEURON = "bandwidth limit", "transformers eager", "transformers static", "neuron"
BATCH1, OFFLINE_A, OFFLINE_B = "batch-1 decode", "offline (a)", "offline (b)"


@dataclass(slots=True)
class Row:
    part: str
    shape: str
    engine: str
    figure: str
    unit: str
    value: float | None = None
    error: str | None = None
    note: str = ""
    vs_transformers: float | None = None  # neuron / the transformers figure named in the note
    vs_limit: float | None = None  # this figure / the batch-1 decode bandwidth limit
    detail: dict = field(default_factory=dict)


def find(rows: list[Row], part: str, shape: str, engine: str, figure: str) -> Row | None:
    return next((r for r in rows if (r.part, r.shape, r.engine, r.figure) == (part, shape, engine, figure)), None)


def ratio(num: float | None, row: Row | None) -> float | None:
    return num / row.value if num is not None and row is not None and row.value else None


def add_ratios(rows: list[Row], small: str, batch: int, served_engine: str) -> None:
    """neuron / transformers (static-cache compiled at batch 1, one padded batch offline), every
    batch-1 figure / the bandwidth limit, and served / offline throughput at the same batch (offline
    by `served_engine`, the neuron configuration the server ran)."""
    for r in list(rows):
        if r.value is None:
            continue
        if r.figure == BATCH1 and r.part in ("decode", "tp2"):
            r.vs_limit = ratio(r.value, find(rows, "bandwidth", r.shape, LIMIT, BATCH1))
            if r.engine.startswith(NEURON):
                r.vs_transformers = ratio(r.value, find(rows, "decode", r.shape, HF_STATIC, BATCH1))
        if r.part == "offline" and r.engine.startswith(NEURON) and r.figure == OFFLINE_A:
            r.vs_transformers = ratio(r.value, find(rows, "offline", r.shape, HF_EAGER, OFFLINE_A))
    served = find(rows, "serve", small, "neuron serve", f"concurrency {batch}")
    if served is None:
        return
    offline = find(rows, "offline", small, served_engine, OFFLINE_A)
    row = Row("serve", small, "neuron serve / offline", f"c={batch} / offline (a) batch of {batch}", "x",
              note="output tok/s served at this concurrency / offline (a) output tok/s")
    row.value = ratio(served.value, offline)
    if row.value is None:
        row.error = "n/a: offline (a) not measured" if offline is None else "n/a: a figure it divides failed"
    rows.append(row)


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def _ratio(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def fmt_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict) -> str:
    lines = ["# neuron GPU benchmark", "", "| environment | |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in doc["env"].items()]
    lines += ["", "| part | shape | engine | figure | value | unit | vs transformers | vs limit | note |",
              "|---|---|---|---|---:|---|---:|---:|---|"]
    for r in doc["rows"]:
        value = fmt(r["value"]) if r["error"] is None else r["error"]
        ratios = [_ratio(r["vs_transformers"]), _ratio(r["vs_limit"])]
        cells = [r["part"], r["shape"], r["engine"], r["figure"], value, r["unit"], *ratios, r["note"]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "vs transformers: neuron / transformers static-cache compiled `generate` at batch 1 (decode, tp2), "
              "neuron / transformers eager `generate` of one padded batch (offline (a)). vs limit: tok/s / (device "
              "copy bandwidth / bytes of weights read per token); the KV cache read is left out. Random weights, "
              "token-id prompts, EOS ignored: every run is full length."]
    return "\n".join(lines) + "\n"
