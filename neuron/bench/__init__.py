"""`neuron bench`: a streaming load generator for any OpenAI-compatible endpoint.

    import anyio
    from neuron.bench import BenchConfig, run_benchmark, format_table

    result = anyio.run(run_benchmark, BenchConfig("http://127.0.0.1:8000/v1", num_requests=64, concurrency=8))
    print(format_table(result))
"""

from neuron.bench.load import BenchConfig, BenchError, BenchResult, RequestRecord, run_benchmark
from neuron.bench.report import Stats, Summary, describe, format_table, result_summary, summarize, to_json, write_plot

__all__ = ["BenchConfig", "BenchError", "BenchResult", "RequestRecord", "Stats", "Summary", "describe",
           "format_table", "result_summary", "run_benchmark", "summarize", "to_json", "write_plot"]
