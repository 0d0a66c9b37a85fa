"""What the decoder-only models share: embed, run the layers, norm, vocabulary-parallel head."""

from __future__ import annotations

import torch

from neuron.errors import ConfigError
from neuron.layers import quantized
from neuron.models import prompt_logprobs
from neuron.step import VerifyShape


class CausalLM:
    """Subclasses set `embed`, `layers`, `norm`, `lm_head`, `rotary` and `cache`, and list each
    layer's weights in `layer_tensors`."""

    # Whether a decode step depends only on device tensors (no per-slot host state), so it can be
    # captured in a CUDA graph; `graphs` holds them once captured (neuron/models/cuda_graphs.py).
    supports_cuda_graphs = False
    graphs = None
    verify_graphs = None  # speculative decoding's verifying steps, captured apart

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
    def forward(self, batch) -> torch.Tensor | None:
        """Run the new tokens of every sequence; return rank 0's float32 logits of each sequence's
        last token ([num_seqs, vocab]), None on other ranks."""
        assert self.cache is not None
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None and graphs.fits(batch):
                return graphs.run(batch)
        return self.run(self.embed(batch.token_ids), batch.positions, batch)

    def capture_decode_graphs(self, max_batch: int, verify: VerifyShape = VerifyShape()) -> None:
        """Record decode steps of up to `max_batch` sequences in CUDA graphs (see cuda_graphs.py), and
        with speculative decoding its verifying steps (`verify`: tokens per sequence, and the most
        sequences that speculate in one step)."""
        from neuron.models.cuda_graphs import capture_decode_graphs

        self.graphs = capture_decode_graphs(self, max_batch)
        if verify.tokens > 1 and verify.batch > 0:
            self.verify_graphs = capture_decode_graphs(self, min(max_batch, verify.batch), verify.tokens)

    def release_graphs(self) -> None:
        """Free the captured graphs (and their memory pool) now, not when garbage collection gets to them."""
        for name in ("graphs", "verify_graphs"):
            graphs = getattr(self, name)
            if graphs is not None:
                graphs.release()
                setattr(self, name, None)

    def run(self, x: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor | None:
        """The layers, norm and head over input embeddings `x` at `positions`."""
        rope = self.rotary.tables(positions)
        for layer in self.layers:
            x = layer(x, batch, rope, self.cache)
        if batch.prompt_topk is not None:
            batch.prompt_out = prompt_logprobs.compute(self, x, batch)
        last = x if batch.all_decode else x[batch.last_index]
        logits = self.lm_head(self.norm(last))
        return None if logits is None else logits.float()
