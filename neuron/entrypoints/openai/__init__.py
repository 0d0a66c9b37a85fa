"""The OpenAI-compatible HTTP server behind `neuron serve`."""
