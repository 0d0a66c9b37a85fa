"""Images for vision models: decoding `data:` URIs, the guards an image meets before any device
work, deterministic preprocessing, placeholder expansion and multimodal positions.

The leader and every rank run the same code on the same bytes: the leader to refuse bad images
and to learn each image's grid (how many `<|image_pad|>` tokens it fills), the ranks to turn the
bytes into identical pixels for their replicated vision tower. Nothing is broadcast, and nothing
is fetched: only `data:` URIs are accepted, never URLs or file paths.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from neuron.config import settings
from neuron.errors import NeuronError


class ImageError(NeuronError):
    """An image refused before any device work; `status` and `code` are what the API answers."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_image"):
        super().__init__(message)
        self.status = status
        self.code = code


def vision_unsupported() -> ImageError:
    return ImageError("this model does not accept images; send text content only", code="vision_unsupported")


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """How a checkpoint turns images into patches and placeholder tokens (config.json's
    `vision_config` and token ids, preprocessor_config.json's sizes and normalisation)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_token_id: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    depth: int

    @classmethod
    def from_configs(cls, config: dict, pre: dict) -> "VisionSpec | None":
        """The spec of a checkpoint with a vision tower (its config.json and preprocessor_config.json,
        as the model's configuration read them), None for a text-only one."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict) or "image_token_id" not in config:
            return None
        size = pre.get("size") or {}
        return cls(
            patch_size=int(pre.get("patch_size", vision.get("patch_size", 16))),
            temporal_patch_size=int(pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
            merge_size=int(pre.get("merge_size", vision.get("spatial_merge_size", 2))),
            min_pixels=int(size.get("shortest_edge", pre.get("min_pixels", 65536))),
            max_pixels=int(size.get("longest_edge", pre.get("max_pixels", 16777216))),
            mean=tuple(float(x) for x in pre.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(float(x) for x in pre.get("image_std", (0.5, 0.5, 0.5))),
            image_token_id=int(config["image_token_id"]),
            hidden_size=int(vision.get("hidden_size", 1152)),
            intermediate_size=int(vision.get("intermediate_size", 4304)),
            num_heads=int(vision.get("num_heads", 16)),
            depth=int(vision.get("depth", 27)),
        )

    @classmethod
    def from_wire(cls, fields: dict) -> "VisionSpec":
        """The spec a rank's load message carries (its fields, as JSON keeps them)."""
        return cls(**{**fields, "mean": tuple(fields["mean"]), "std": tuple(fields["std"])})

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True, slots=True)
class ImageInput:
    """A checked image: its URI (what travels to the ranks) and its patch grid (time, height, width)."""

    uri: str
    width: int
    height: int
    grid: tuple[int, int, int]
    merge_size: int

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens the image fills in the prompt (patches after spatial merging)."""
        return self.num_patches // (self.merge_size * self.merge_size)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size an image is resized to: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as nearly as those allow."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds 200:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    if h < factor or w < factor:
        raise ImageError(f"a {width}x{height} image cannot be resized to whole patches of {factor} pixels")
    return h, w


def decode_data_uri(uri: object) -> bytes:
    """The bytes of a base64 `data:` URI; anything else is refused (no fetching, no files)."""
    if not isinstance(uri, str) or not uri.startswith("data:"):
        shown = repr(uri)[:60] if not isinstance(uri, str) else uri[:60]
        raise ImageError(f"only base64 data: URIs are accepted for images (data:image/png;base64,...); "
                         f"got {shown!r}. URLs and file paths are not fetched", code="invalid_image_url")
    header, sep, payload = uri[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("an image data: URI must be base64-encoded (data:<type>;base64,<data>)",
                         code="invalid_image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data: URI is not valid base64") from None


def open_image(uri: str, max_pixels: int | None = None, decode: bool = True):
    """Decode an image fully (so a truncated or corrupt one fails here, not on a rank). Refuses
    images over `max_pixels` (NEURON_VISION_MAX_PIXELS) from their header, before decoding.
    `decode=False` reads the header alone: the size, at the cost of parsing a few bytes."""
    from PIL import Image, UnidentifiedImageError

    data = decode_data_uri(uri)
    limit = settings().vision_max_pixels if max_pixels is None else max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            w, h = image.size
            if w * h > limit:
                raise ImageError(f"image is {w}x{h} = {w * h} pixels, over the limit of {limit} "
                                 "(NEURON_VISION_MAX_PIXELS)", status=413, code="image_too_large")
            if decode:
                image.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image is too large: {exc}", status=413, code="image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"the image could not be decoded: {exc}") from None
    if w < 1 or h < 1:
        raise ImageError(f"image has no pixels ({w}x{h})")
    return image


def check_image(uri: str, spec: VisionSpec, decode: bool = True) -> ImageInput:
    """Size one image as the ranks will, from its header, and decode it unless `decode` is False:
    the leader's guard and grid."""
    image = open_image(uri, decode=decode)
    h, w = smart_resize(image.height, image.width, spec.factor, spec.min_pixels, spec.max_pixels)
    return ImageInput(uri, image.width, image.height, (1, h // spec.patch_size, w // spec.patch_size),
                      spec.merge_size)


def to_rgb(image):
    """RGB, with any transparency composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(uri: str, spec: VisionSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Pixels of one image as the vision tower takes them: resized (bicubic) to multiples of the
    merged patch, scaled to [0, 1], normalised, cut into patches in merge-block order, each patch
    repeated over the temporal patch. Returns ([patches, C*T*P*P] float32, grid)."""
    from PIL import Image

    image = to_rgb(open_image(uri))
    h, w = smart_resize(image.height, image.width, spec.factor, spec.min_pixels, spec.max_pixels)
    resized = np.asarray(image.resize((w, h), resample=Image.BICUBIC))  # [h, w, 3] uint8
    x = (resized.astype(np.float64) / 255.0).astype(np.float32)
    x = (x - np.asarray(spec.mean, dtype=np.float32)) / np.asarray(spec.std, dtype=np.float32)
    x = np.ascontiguousarray(x.transpose(2, 0, 1))  # [3, h, w]
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # blocks, in-block, C, P, P
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    patches = torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p))
    return patches, (1, gh, gw)


def expand_placeholders(token_ids: list[int], image_token_id: int, images: list[ImageInput]) -> list[int]:
    """Replace the i-th lone image placeholder with `images[i].num_tokens` copies of it."""
    count = token_ids.count(image_token_id)
    if count != len(images):
        raise ImageError(f"the prompt has {count} image placeholder(s) but {len(images)} image(s) were given")
    out: list[int] = []
    it = iter(images)
    for t in token_ids:
        if t == image_token_id:
            out += [t] * next(it).num_tokens
        else:
            out.append(t)
    return out


def image_spans(token_ids: list[int], image_token_id: int, tokens_per_image: list[int]) -> list[tuple[int, int]]:
    """Where each image's placeholder tokens lie, as [start, end) spans: the i-th image takes the
    next `tokens_per_image[i]` placeholders, which must be contiguous. ValueError otherwise."""
    spans, i, n = [], 0, len(token_ids)
    for k, count in enumerate(tokens_per_image):
        while i < n and token_ids[i] != image_token_id:
            i += 1
        if i + count > n or any(t != image_token_id for t in token_ids[i : i + count]):
            raise ValueError(f"image {k} needs {count} contiguous placeholder tokens ({image_token_id}) "
                             "that the tokens do not have")
        spans.append((i, i + count))
        i += count
    if image_token_id in token_ids[i:]:
        raise ValueError(f"more image placeholder tokens than the {len(tokens_per_image)} image(s) fill")
    return spans


def mrope_positions(length: int, spans: list[tuple[int, int]], grids: list[tuple[int, int, int]],
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """Multimodal positions [3, length] (time, height, width) and the shift later text positions
    take (`position = index + shift`). Text advances all axes together; an image's tokens sit on
    its merged grid starting at the running position, which then advances by the grid's longer side."""
    pos = torch.empty((3, length), dtype=torch.long)
    at = cursor = 0
    for (start, end), (t, h, w) in zip(spans, grids):
        pos[:, at:start] = torch.arange(cursor, cursor + start - at)
        cursor += start - at
        gh, gw = h // merge_size, w // merge_size
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[0, start:end] = tt.reshape(-1) + cursor
        pos[1, start:end] = hh.reshape(-1) + cursor
        pos[2, start:end] = ww.reshape(-1) + cursor
        cursor += max(gh, gw)
        at = end
    pos[:, at:] = torch.arange(cursor, cursor + length - at)
    cursor += length - at
    return pos, cursor - length


def vision_activation_bytes(spec: VisionSpec, images: list[ImageInput], dtype_bytes: int) -> int:
    """A generous bound on the vision tower's transient memory for these images: the pixels,
    hidden states and MLP activations of every patch. Attention never holds an image's scores
    whole (the tower calls SDPA's memory-efficient kernels), only tiles of them."""
    patches = sum(i.num_patches for i in images)
    pixels = 3 * spec.temporal_patch_size * spec.patch_size ** 2 * 4
    per_patch = (8 * spec.hidden_size + 2 * spec.intermediate_size) * dtype_bytes + pixels
    return 2 * patches * per_patch + 64 * 2**20


__all__ = [
    "ImageError",
    "ImageInput",
    "VisionSpec",
    "check_image",
    "decode_data_uri",
    "expand_placeholders",
    "image_spans",
    "mrope_positions",
    "open_image",
    "preprocess",
    "smart_resize",
    "vision_activation_bytes",
    "vision_unsupported",
]
