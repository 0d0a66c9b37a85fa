"""Prefill of Qwen3.5 prompts that hold images: the replicated vision tower embeds the images,
whose embeddings replace the prompt's placeholder tokens at multimodal (time, height, width)
positions, and every rank walks the prompts in the same chunks so the collectives pair up."""

from __future__ import annotations

import itertools
import math

import torch

from neuron.models.inputs import StepRejected
from neuron.multimodal.image import ImageError, image_spans, mrope_positions, preprocess
from neuron.step import SeqStep


@torch.inference_mode()
def prefill_with_images(model, tables, seqs: list[SeqStep], image_token_id: int,
                        image_data_uris: list[str], chunk_size: int) -> torch.Tensor | None:
    """Prefill whole sequences whose tokens hold image placeholders, in chunks of `chunk_size`
    tokens (every rank walks the same chunks, so the collectives pair up). The images go to
    the sequences in order, each taking the next run of placeholders its grid fills. Returns
    rank 0's logits of each sequence's last token. Everything is checked before the first
    collective; a bad request raises StepRejected on every rank alike."""
    assert model.cache is not None and model.vision is not None
    if chunk_size < 1:
        raise StepRejected(f"chunk_size must be >= 1, got {chunk_size}")
    if not seqs:
        raise StepRejected("a step with images needs at least one sequence")
    for s in seqs:
        if not s.fresh or s.offset != 0:
            raise StepRejected(f"slot {s.slot}: a step with images prefills a whole sequence from "
                               "position 0 (fresh, offset 0)")
    tables.check(seqs, model.config.vocab_size)
    model.cache.check(seqs, model.config.vocab_size)
    embeds, grids, first_rows = _embeddings(model, image_data_uris)
    layouts = _layouts(model, seqs, grids, first_rows, image_token_id)
    return _walk_chunks(model, tables, seqs, layouts, embeds, chunk_size)


def _embeddings(model, uris: list[str]) -> tuple[torch.Tensor | None, list, list[int]]:
    """The embeddings of the step's distinct images, one after another, each image's grid, and
    the row each image's tokens start at. Images the cache holds skip the tower; an image the step
    carries twice runs through it once. A bad image rejects the step."""
    if not uris:
        return None, [], []
    cache = model.vision.embeddings
    keys = [cache.key(u) for u in uris]
    found = {k: hit for k in dict.fromkeys(keys) if (hit := cache.get(k)) is not None}
    missing = [(i, k) for i, k in enumerate(keys) if k not in found and keys.index(k) == i]
    if missing:
        pixels, grids = _preprocess(model, [(i, uris[i]) for i, _ in missing])
        out = model.vision(torch.cat(pixels), grids)
        merge2 = model.vision_spec.merge_size ** 2
        for (_, k), grid, e in zip(missing, grids, out.split([math.prod(g) // merge2 for g in grids])):
            found[k] = (grid, e)
            cache.put(k, grid, e)
    order = list(dict.fromkeys(keys))
    starts = dict(zip(order, itertools.accumulate((found[k][1].shape[0] for k in order[:-1]), initial=0)))
    embeds = torch.cat([found[k][1] for k in order])
    return embeds, [found[k][0] for k in keys], [starts[k] for k in keys]


def _preprocess(model, images: list[tuple[int, str]]) -> tuple[list[torch.Tensor], list]:
    """Patches and grid of each (index, URI); a bad image rejects the step, naming its index."""
    pixels, grids = [], []
    for i, uri in images:
        try:
            patches, grid = preprocess(uri, model.vision_spec)
        except ImageError as exc:
            raise StepRejected(f"image {i}: {exc}") from None
        pixels.append(patches)
        grids.append(grid)
    return pixels, grids


def _layouts(model, seqs: list[SeqStep], grids: list, first_rows: list[int], image_token_id: int) -> list[tuple]:
    """Per sequence: its multimodal positions, the embedding row each placeholder takes (-1 for
    text tokens) and the position shift of the text after its images."""
    merge2 = model.vision_spec.merge_size ** 2
    layouts, used = [], 0  # images taken so far
    for s in seqs:
        want = s.token_ids.count(image_token_id)
        counts, take = [], used
        while sum(counts) < want and take < len(grids):
            counts.append(math.prod(grids[take]) // merge2)
            take += 1
        try:
            spans = image_spans(s.token_ids, image_token_id, counts)
        except ValueError as exc:
            raise StepRejected(f"slot {s.slot}: {exc}") from None
        positions, shift = mrope_positions(len(s.token_ids), spans, grids[used:take], model.vision_spec.merge_size)
        source = torch.full((len(s.token_ids),), -1, dtype=torch.long)
        for (start, end), first in zip(spans, first_rows[used:take]):
            source[start:end] = torch.arange(first, first + end - start)
        layouts.append((positions.to(model.device), source.to(model.device), shift))
        used = take
    if used != len(grids):
        raise StepRejected(f"{len(grids)} image(s) but the tokens hold placeholders for {used}")
    return layouts


def _walk_chunks(model, tables, seqs: list[SeqStep], layouts: list, embeds: torch.Tensor | None,
                 chunk_size: int) -> torch.Tensor | None:
    lengths = [len(s.token_ids) for s in seqs]
    last: list[torch.Tensor | None] = [None] * len(seqs)
    for k in range(max(math.ceil(n / chunk_size) for n in lengths)):
        sub, members = [], []
        for i, s in enumerate(seqs):
            a, b = k * chunk_size, min((k + 1) * chunk_size, lengths[i])
            if a < b:
                first = k == 0
                sub.append(SeqStep(s.slot, s.token_ids[a:b], a, s.new_blocks if first else [], s.fresh and first))
                members.append((i, a, b))
        batch = tables.prepare(sub)
        model.cache.begin(sub)
        x = model.embed(batch.token_ids)
        positions, rows, sources, base = [], [], [], 0
        for i, a, b in members:
            pos, source, _ = layouts[i]
            positions.append(pos[:, a:b])
            src = source[a:b]
            hit = (src >= 0).nonzero().squeeze(1)
            if hit.numel():
                rows.append(hit + base)
                sources.append(src[hit])
            base += b - a
        if rows:
            x[torch.cat(rows)] = embeds[torch.cat(sources)].to(x.dtype)
        logits = model.run(x, torch.cat(positions, dim=1), batch)
        tables.commit(batch)
        model.cache.commit(batch)
        if logits is not None:
            for j, (i, a, b) in enumerate(members):
                if b == lengths[i]:
                    last[i] = logits[j]
    for s, (_, _, shift) in zip(seqs, layouts):
        model.cache.shift[s.slot] = shift
    return None if last[0] is None else torch.stack(last)
