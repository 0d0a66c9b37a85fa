"""Images in Qwen3.5 prompts, on the ordinary chunked step.

A sequence's first step (`fresh`) carries its prompt's images: each a `data:` URI and where its
run of placeholder tokens starts (`neuron.step.StepImage`). Every rank decodes them the same way
before any collective, refusing a bad image or a layout its tokens do not match alike, and keeps
the sequence's layout for its slot: the multimodal (time, height, width) positions of its tokens
up to the last image, which embedding row each placeholder takes, and the shift of the text after
the images. The first chunk that reaches an image's placeholders runs the replicated vision tower
once for all of the sequence's images (the tower's `EmbeddingCache` spares it images seen
recently); later chunks read the embeddings from the slot. Once the prefill has passed its last
image they are freed; the shift stays with the slot for decoding (`HybridCache.shift`). The
scheduler chunks these prompts like any other, so their prefill interleaves with other requests'
decode steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from neuron.models.inputs import StepBatch, StepRejected
from neuron.models.qwen3_5_vision import VisionTower
from neuron.multimodal.image import ImageError, VisionSpec, mrope_positions, preprocess
from neuron.step import SeqStep


@dataclass(slots=True)
class _Image:
    """One image of a sequence: its cache key and grid, and until the tower ran its patches."""

    key: bytes
    grid: tuple[int, int, int]
    patches: torch.Tensor | None  # None once embedded (or found embedded)
    embeds: torch.Tensor | None


@dataclass(slots=True)
class _Layout:
    """A prefilling sequence's images and where their tokens sit."""

    images: list[_Image]
    spans: list[tuple[int, int]]  # [start, end) of each image's placeholders
    end: int  # the last image's end: positions from here on are text at `index + shift`
    positions: torch.Tensor  # [3, end] multimodal positions
    source: torch.Tensor  # [end] the embedding row each position takes (-1: text)
    shift: int
    embeds: torch.Tensor | None = None  # the images' rows, one after another, once the tower ran


class SlotImages:
    """Per slot, the layout and embeddings of a sequence whose prefill has not passed its images."""

    def __init__(self, tower: VisionTower, spec: VisionSpec, slots: int, max_len: int, device):
        self.tower, self.spec = tower, spec
        self.max_len, self.device = max_len, device
        self.layouts: list[_Layout | None] = [None] * slots
        self._checked: dict[int, tuple[list[_Image], list[tuple[int, int]]]] = {}  # by slot, for `begin`

    # ---- before any collective ----

    def check(self, seqs: list[SeqStep]) -> None:
        """Refuse what would misplace an image (StepRejected): images on a step that is not a
        sequence's first, an image that does not decode, spans that overlap or pass the model's
        length, and chunk tokens that do not match the placeholders where the spans say (checked as
        each chunk arrives). The images found good are kept for `begin`."""
        checked, decoded = {}, {}
        for s in seqs:
            if s.images:
                if not s.fresh:
                    raise StepRejected(f"slot {s.slot}: images travel on a sequence's first step only")
                images = [self._decode(s.slot, i, image.uri, decoded) for i, image in enumerate(s.images)]
                spans = self._spans(s, images)
                checked[s.slot] = (images, spans)
            elif s.fresh or self.layouts[s.slot] is None:
                continue
            else:
                spans = self.layouts[s.slot].spans
            self._check_tokens(s, spans)
        self._checked = checked

    def _decode(self, slot: int, index: int, uri: str, decoded: dict) -> _Image:
        """The image's embeddings when the tower's cache holds them, else its patches (decoded once
        per step however many sequences carry it)."""
        cache = self.tower.embeddings
        key = cache.key(uri)
        if (hit := cache.get(key)) is not None:
            return _Image(key, hit[0], None, hit[1])
        if key not in decoded:
            try:
                decoded[key] = preprocess(uri, self.spec)
            except ImageError as exc:
                raise StepRejected(f"slot {slot}: image {index}: {exc}") from None
        patches, grid = decoded[key]
        return _Image(key, grid, patches, None)

    def _spans(self, s: SeqStep, images: list[_Image]) -> list[tuple[int, int]]:
        merge2 = self.spec.merge_size ** 2
        spans, at = [], 0
        for i, (image, step_image) in enumerate(zip(images, s.images)):
            start, count = step_image.start, math.prod(image.grid) // merge2
            if start < at:
                raise StepRejected(f"slot {s.slot}: image {i} starts at {start}, inside what comes before it "
                                   f"(up to {at})")
            if start + count > self.max_len:
                raise StepRejected(f"slot {s.slot}: image {i}'s {count} tokens from {start} pass the model's "
                                   f"length {self.max_len}")
            spans.append((start, start + count))
            at = start + count
        return spans

    def _check_tokens(self, s: SeqStep, spans: list[tuple[int, int]]) -> None:
        """The chunk's tokens before the last image's end are placeholders inside the spans and
        text outside them."""
        placeholder, ids, offset = self.spec.image_token_id, s.token_ids, s.offset
        at = 0
        for start, end in spans:
            text = ids[max(at - offset, 0) : max(start - offset, 0)]
            run = ids[max(start - offset, 0) : max(end - offset, 0)]
            if placeholder in text or run.count(placeholder) != len(run):
                raise StepRejected(f"slot {s.slot}: its tokens do not hold the image placeholders "
                                   f"({placeholder}) where its images' spans say, {start}..{end}")
            at = end

    # ---- the step ----

    def begin(self, seqs: list[SeqStep]) -> None:
        """A sequence new to its slot takes the layout of the images it carries (or none)."""
        for s in seqs:
            if s.fresh:
                found = self._checked.get(s.slot)
                self.layouts[s.slot] = None if found is None else self._layout(*found)
        self._checked = {}

    def _layout(self, images: list[_Image], spans: list[tuple[int, int]]) -> _Layout:
        end = spans[-1][1]
        positions, shift = mrope_positions(end, spans, [image.grid for image in images], self.spec.merge_size)
        source = torch.full((end,), -1, dtype=torch.long)
        first = 0
        for start, stop in spans:
            source[start:stop] = torch.arange(first, first + stop - start)
            first += stop - start
        return _Layout(images, spans, end, positions.to(self.device), source.to(self.device), shift)

    def shift(self, slot: int) -> int:
        """Where the text after the slot's images sits: `index + shift` (0 without images)."""
        layout = self.layouts[slot]
        return 0 if layout is None else layout.shift

    def encode(self, batch: StepBatch) -> None:
        """Run the vision tower for each sequence whose chunk first reaches its images, one sequence
        at a time (the tower's memory was checked per request when it was admitted)."""
        for layout, offset, n, _ in self._reaching(batch):
            if layout.embeds is None and offset + n > layout.spans[0][0]:
                layout.embeds = self._embed(layout.images)

    def _embed(self, images: list[_Image]) -> torch.Tensor:
        """The sequence's image rows, one image after another: from the cache where it holds them
        (another sequence of this step may have put them there meanwhile), else from one tower run
        over its distinct missing images."""
        cache, merge2 = self.tower.embeddings, self.spec.merge_size ** 2
        for image in images:
            if image.embeds is None and (hit := cache.get(image.key)) is not None:
                image.embeds = hit[1]
        missing = list({image.key: image for image in images if image.embeds is None}.values())
        if missing:
            out = self.tower(torch.cat([m.patches for m in missing]), [m.grid for m in missing])
            made = out.split([math.prod(m.grid) // merge2 for m in missing])
            for m, e in zip(missing, made):
                cache.put(m.key, m.grid, e)
            by_key = {m.key: e for m, e in zip(missing, made)}
            for image in images:
                if image.embeds is None:
                    image.embeds = by_key[image.key]
        for image in images:
            image.patches = None
        return torch.cat([image.embeds for image in images])

    def place(self, x: torch.Tensor, positions: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's input embeddings with the images' rows where chunks reach placeholders, and
        its positions with the multimodal ones there ([3, T] once any sequence has images)."""
        reaching = self._reaching(batch)
        if not reaching:
            return x, positions
        positions = positions.expand(3, -1).clone() if positions.dim() == 1 else positions
        for layout, offset, n, row in reaching:
            stop = min(offset + n, layout.end)
            if stop <= offset:
                continue
            positions[:, row : row + stop - offset] = layout.positions[:, offset:stop]
            source = layout.source[offset:stop]
            hit = (source >= 0).nonzero().squeeze(1)
            if hit.numel():
                x[hit + row] = layout.embeds[source[hit]].to(x.dtype)
        return x, positions

    def _reaching(self, batch: StepBatch) -> list[tuple[_Layout, int, int, int]]:
        """(layout, offset, length, first row in the flat batch) of the step's sequences with images."""
        out, row = [], 0
        for slot, n, kv_len in zip(batch.slots, batch.lengths, batch.kv_lens):
            layout = self.layouts[slot]
            if layout is not None:
                out.append((layout, kv_len - n, n, row))
            row += n
        return out

    def commit(self, batch: StepBatch) -> None:
        """A prefill that has passed its last image frees the slot's embeddings."""
        for slot, kv_len in zip(batch.slots, batch.kv_lens):
            layout = self.layouts[slot]
            if layout is not None and kv_len >= layout.end:
                self.layouts[slot] = None

    def clear(self, slots) -> None:
        for slot in slots:
            self.layouts[slot] = None
