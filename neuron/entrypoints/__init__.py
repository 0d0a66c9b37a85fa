"""What users run: the `neuron` command, the offline `LLM` API and the OpenAI-compatible server."""
