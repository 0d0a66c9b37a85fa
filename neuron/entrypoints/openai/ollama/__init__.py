"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/ps, /api/show and /api/version, for
the apps that speak it.

A translation, not a second server: a chat or a templated generate becomes the chat path's request
(`ChatCompletionRequest`: its template, tools, reasoning switch, structured output and images) and
is opened by `open_chat`; a raw generate is tokenized and opened as /v1/completions opens a text
prompt. What comes back is the same engine stream, parsed by the chat path's parser and written
as Ollama writes it: one JSON object a line (NDJSON) while it streams, the default, or one object
with `"stream": false`, the last carrying `done`, `done_reason` and the counts and durations
(nanoseconds). Errors are Ollama's `{"error": "..."}` with the status the OpenAI routes would give.

Options map onto the sampling params; those neuron cannot honour are refused by name, those that
are the server's own settings (num_ctx, num_gpu, num_thread, ...) are ignored, as Ollama ignores
options it does not know. `keep_alive` sets how long an on-demand model stays loaded once idle
(the host's keep_alive); a model loaded at start-up stays loaded. neuron never downloads, pushes
or creates models: those routes answer a clear error.
"""

from neuron.entrypoints.openai.ollama.protocol import OLLAMA_API_VERSION, ollama_error
from neuron.entrypoints.openai.ollama.routes import Served, ollama_routes

__all__ = ["OLLAMA_API_VERSION", "Served", "ollama_error", "ollama_routes"]
