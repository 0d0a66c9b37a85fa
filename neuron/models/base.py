"""What the decoder-only models share: embed, run the layers, norm, vocabulary-parallel head."""

from __future__ import annotations

import torch

from neuron.errors import ConfigError
from neuron.layers import quantized
from neuron.models import pooling, prompt_logprobs
from neuron.models.inputs import KeptRows, StepBatch, kept_rows


class CausalLM:
    """Subclasses set `comm`, `embed`, `layers`, `norm`, `lm_head`, `rotary` and `cache`, and list
    each layer's weights in `layer_tensors`."""

    # Whether a decode step reads only the batch's device tensors (no per-slot state kept on the
    # host), so that the model runner may replay it from a CUDA graph (neuron/worker/cuda_graphs.py).
    decode_on_device_only = False
    # What the KV pool holds (the runner sets it before sizing the pool); None: the model dtype.
    kv_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    def check_model_len(self, max_model_len: int, native: int) -> None:
        if max_model_len > native:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {native}")

    def layer_tensors(self, layer) -> list[torch.Tensor]:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        tensors = [self.embed.weight, self.lm_head.weight, self.norm.weight]
        for layer in self.layers:
            tensors += self.layer_tensors(layer)
        tensors = [t for w in tensors for t in quantized.tensors(w)]
        unique = {t.data_ptr(): t for t in tensors}  # tied embeddings count once
        return sum(t.numel() * t.element_size() for t in unique.values())

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """Run the new tokens of every sequence; return rank 0's float32 logits of each sequence's
        last token ([num_seqs, vocab]), None on other ranks."""
        assert self.cache is not None
        return self.run(self.embed(batch.token_ids), batch.positions, batch)

    def run(self, x: torch.Tensor, positions: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """The layers, norm and head over input embeddings `x` at `positions`."""
        kept = kept_rows(batch)
        x = self.run_layers(x, batch, self.rotary.tables(positions), kept)
        if batch.prompt_topk is not None:
            batch.prompt_out = prompt_logprobs.compute(self, x, batch)
        if batch.pool is not None and self.comm.rank == 0:
            batch.pool_out = pooling.compute(self, x, batch)
        last = x if batch.all_decode or kept is not None else x[batch.last_index]
        logits = self.lm_head(self.norm(last))
        return None if logits is None else logits.float()

    def run_layers(self, x: torch.Tensor, batch: StepBatch, rope: tuple, kept: KeptRows | None = None
                   ) -> torch.Tensor:
        """The decoder layers, one after the other; with `kept`, the last one runs those rows alone
        past storing its keys and values, and its output is theirs."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, rope, self.cache, kept if i == last else None)
        return x
