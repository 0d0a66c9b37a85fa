"""The OpenAI-compatible HTTP server: `neuron serve`."""
