"""Images in a request: how they arrive, are decoded and bounded, and travel to the engine.

An image reaches lmdock as a PIL image, raw bytes, a path, a ``data:`` URL or (in a chat message) a
content part: OpenAI's ``image_url``, Anthropic's ``image`` block, the Responses API's
``input_image``, transformers' ``{"type": "image", "image": ...}``.  :func:`load_image` decodes
each one into an RGB PIL image after checking its size from the file header (a decompression bomb
is refused before its pixels are decoded), and hashes its pixels: the hash keys the engine's
encoded-image cache and the prefix cache, so a prompt with another image never reuses KV state.

:class:`MultiModalData` rides on the :class:`~lmdock._plugin.contract.EngineRequest` and, for a step
engine, on every prefill :class:`~lmdock._plugin.contract.SeqChunk` of the request's sequences.  The
step engine's ``process_multimodal`` (called once, in the submitting thread) expands the prompt's
image placeholders as the model's processor does and stores the processor's outputs
(``pixel_values``...) in ``processed``; docs/authoring-backends.md has the contract.

PIL is imported only when an image is decoded: ``import lmdock`` stays light.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmdock._plugin.errors import RequestError

#: Chat content part types that carry an image (OpenAI chat, Responses, Anthropic, transformers).
IMAGE_PART_TYPES = ("image_url", "input_image", "image")


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on a request's images: the server sets them from ``[server]``; the Python API uses
    the defaults (PIL's own decompression-bomb bound).  ``image_dir``: the folder file paths must lie
    under (None: any path for the Python API; the server refuses paths unless it is set).  ``fetch``:
    ``fetch(url, where) -> bytes`` for http(s) URLs (the server's bounded fetcher where ``[server]
    image_fetch`` is on); None: such URLs are refused."""

    max_pixels: int = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS
    max_images: int | None = None
    image_dir: str | None = None
    allow_paths: bool = True
    fetch: Callable[[str, str], bytes] | None = None


PYTHON_LIMITS = ImageLimits()


@dataclass
class MultiModalData:
    """A request's images, decoded, and what the engine's processor made of them."""

    images: list[Any]  # RGB PIL images, in prompt order
    hashes: tuple[str, ...]  # sha256 of each image's mode, size and pixels
    #: the step engine's processor outputs for the whole prompt (``pixel_values`` ...), set by its
    #: ``process_multimodal``; engine-specific, read only by that engine
    processed: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, ...]:
        """What KV state computed over these images depends on besides the token ids."""
        return self.hashes


def image_hash(image: Any) -> str:
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def multimodal_data(values: Sequence[Any], where: str, limits: ImageLimits = PYTHON_LIMITS) -> MultiModalData:
    """Decode and bound a request's images (``where`` names them in errors)."""
    if limits.max_images is not None and len(values) > limits.max_images:
        raise RequestError(f"{where}: {len(values)} images in one request; this server takes at most {limits.max_images} "
                           "([server] max_images_per_request)")
    images = [load_image(v, f"{where}[{i}]", limits) for i, v in enumerate(values)]
    return MultiModalData(images, tuple(image_hash(im) for im in images))


def split_prompt(prompt: Any) -> tuple[Any, list[Any] | None]:
    """vLLM's ``{"prompt": ..., "multi_modal_data": {"image": ...}}``: the prompt without it, and its
    images (None: no ``multi_modal_data``).  Modalities other than images are refused."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return prompt, None
    mm = prompt["multi_modal_data"]
    rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
    if not isinstance(mm, dict):
        raise RequestError(f"multi_modal_data must be a dict like {{'image': [...]}}, not {type(mm).__name__}")
    other = sorted(set(mm) - {"image"})
    if other:
        raise RequestError(f"multi_modal_data {', '.join(map(repr, other))}: lmdock reads images only ('image')")
    images = mm.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images or any(i is None for i in images):
        raise RequestError("multi_modal_data['image'] is empty: give an image, or a list of them")
    return rest, images


# -- chat content parts ----------------------------------------------------------------------------

def chat_images(messages: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """A conversation with each image part replaced by ``{"type": "image"}`` (what a model's chat
    template renders as its own placeholder), and the images in order, undecoded."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            value = image_of_part(part, f"messages[{i}].content[{j}]")
            if value is None:
                parts.append(part)
            else:
                parts.append({"type": "image"})
                images.append(value)
        out.append({**message, "content": parts})
    return out, images


def image_of_part(part: Any, where: str) -> Any:
    """The image a content part carries (a URL string, bytes, a PIL image), or None for a part that
    is not an image.  A malformed image part is a RequestError naming it."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in IMAGE_PART_TYPES:
        return None
    low = False
    if kind == "image_url":  # OpenAI chat: {"image_url": {"url": ...}} (or the URL alone)
        value = part.get("image_url")
        low = _low_detail(value.get("detail") if isinstance(value, dict) else None, f"{where}.image_url.detail")
        value = value.get("url") if isinstance(value, dict) else value
    elif kind == "input_image":  # Responses: {"image_url": "..."}
        low = _low_detail(part.get("detail"), f"{where}.detail")
        value = part.get("image_url")
        if part.get("file_id") is not None:
            raise RequestError(f"{where}: input_image file_id: lmdock has no file store; send the image as a data URL in image_url")
    else:  # Anthropic {"source": {...}}; transformers {"image": ...} / {"url": ...} / {"path": ...}
        value = _anthropic_source(part["source"], where) if "source" in part else (
            part.get("image") if part.get("image") is not None else part.get("url") or part.get("path"))
    if value is None or value == "":
        raise RequestError(f"{where}: an {kind} part without an image; give a data URL (data:image/png;base64,...)")
    return LowDetail(value) if low else value


@dataclass(frozen=True)
class LowDetail:
    """An image sent with OpenAI's ``detail: "low"``: decoded, then bounded to
    :data:`LOW_DETAIL_SIZE` (aspect ratio kept, never enlarged) before the model's processor sees it."""

    value: Any


#: OpenAI's low-detail image: at most 512 x 512 pixels
LOW_DETAIL_SIZE = (512, 512)


def _low_detail(detail: Any, where: str) -> bool:
    """OpenAI's ``detail``: ``"low"`` bounds the image to 512 x 512 (as OpenAI's low-detail mode);
    ``"high"`` and ``"auto"`` feed it at the resolution the model's processor sets (its highest)."""
    if detail not in (None, "auto", "high", "low"):
        raise RequestError(f"{where} {detail!r}: OpenAI's detail is 'low' (the image bounded to 512x512 first), 'high' or "
                           "'auto' (the resolution the model's processor sets)")
    return detail == "low"


def _anthropic_source(source: Any, where: str) -> Any:
    if not isinstance(source, dict):
        raise RequestError(f"{where}.source must be an object like {{'type': 'base64', 'media_type': 'image/png', 'data': ...}}")
    kind = source.get("type")
    if kind == "base64":
        data = source.get("data")
        if not isinstance(data, str):
            raise RequestError(f"{where}.source.data must be base64 text")
        return _b64(data, f"{where}.source.data")
    if kind == "url":
        return source.get("url")
    raise RequestError(f"{where}.source.type {kind!r}: lmdock takes 'base64' (or 'url', see docs/vision.md)")


def processor_adds_special_tokens(rendered: str, tokenizer: Any) -> bool:
    """Whether a rendered chat prompt with images is tokenized with the tokenizer's special tokens:
    transformers' processor ``apply_chat_template`` adds them unless the prompt starts with BOS (a
    tokenizer's own ``apply_chat_template`` never adds them; lmdock's text-only chat follows that)."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (isinstance(bos, str) and bos and rendered.startswith(bos))


# -- decoding --------------------------------------------------------------------------------------

def load_image(value: Any, where: str, limits: ImageLimits = PYTHON_LIMITS) -> Any:
    """An RGB PIL image from a PIL image, bytes, a path or a data URL; RequestError naming ``where``
    for what cannot be read or is too large."""
    if isinstance(value, LowDetail):
        image = load_image(value.value, where, limits)
        image.thumbnail(LOW_DETAIL_SIZE, resample=3)  # in place, aspect kept, never enlarged; 3: PIL's BICUBIC
        return image
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        value = _fetch(value, where, limits)
    try:
        from PIL import Image
    except ImportError:
        raise RequestError("images need Pillow: pip install pillow (lmdock-hf[vision] installs it)") from None
    if isinstance(value, Image.Image):
        _check_pixels(value.size, where, limits)
        return value.convert("RGB")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode(bytes(value), where, limits)
    if isinstance(value, os.PathLike):
        return decode(_read_path(str(value), where, limits), where, limits)
    if not isinstance(value, str):
        raise RequestError(f"{where}: an image is a PIL image, bytes, a path or a data URL, not {type(value).__name__}")
    if value.startswith("data:"):
        return decode(_data_url(value, where), where, limits)
    path = value[len("file://"):] if value.startswith("file://") else value
    return decode(_read_path(path, where, limits), where, limits)


def _fetch(url: str, where: str, limits: ImageLimits) -> bytes:
    if limits.fetch is None:
        raise RequestError(f"{where}: lmdock does not fetch images over http(s) unless `lmdock serve` has [server] image_fetch "
                           "= true (the Python API never does); send the image inline as a data URL (data:image/png;base64,...)"
                           " or, on a server with [server] image_dir set, a file path under it")
    return limits.fetch(url, where)


def decode(data: bytes, where: str, limits: ImageLimits) -> Any:
    """Decode image bytes, checking the pixel count from the header before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as exc:
        raise RequestError(f"{where}: the image is too large to decode ({exc})") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RequestError(f"{where}: not a decodable image ({type(exc).__name__}: {exc}); send PNG, JPEG, GIF or WebP bytes") from None
    _check_pixels(image.size, where, limits)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise RequestError(f"{where}: the image data is corrupt ({type(exc).__name__}: {exc})") from None
    return image.convert("RGB")


def _check_pixels(size: tuple[int, int], where: str, limits: ImageLimits) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise RequestError(f"{where}: the image is {w}x{h} pixels: empty")
    if w * h > limits.max_pixels:
        raise RequestError(f"{where}: the image is {w}x{h} = {w * h} pixels, over the bound of {limits.max_pixels} "
                           "([server] max_image_pixels); send a smaller image")


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise RequestError(f"{where}: a data URL must be base64 (data:image/png;base64,...)")
    if not head[len("data:"):].startswith("image/"):
        raise RequestError(f"{where}: the data URL's media type {head[5:-7]!r} is not an image type (image/png, image/jpeg...)")
    return _b64(payload, where)


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the image's base64 data does not decode") from None


def _read_path(path: str, where: str, limits: ImageLimits) -> bytes:
    if not limits.allow_paths:
        raise RequestError(f"{where}: this server reads no image files; send the image as a data URL, or set [server] image_dir "
                           "to a folder whose images it may read")
    target = Path(path).resolve()
    if limits.image_dir is not None:
        root = Path(limits.image_dir).resolve()
        if not target.is_relative_to(root):
            raise RequestError(f"{where}: {path!r} is not under the server's image_dir; send a path under it or a data URL")
    try:
        return target.read_bytes()
    except OSError as exc:
        raise RequestError(f"{where}: cannot read the image file {path!r} ({exc.strerror or exc})") from None


# -- into a request ---------------------------------------------------------------------------------

def prepare(engine: Any, backend: Any, text: Any, values: list[Any], add_special_tokens: bool,
            limits: ImageLimits = PYTHON_LIMITS) -> tuple[list[int], MultiModalData]:
    """A prompt with images as the engine takes it: its token ids (placeholders expanded by the
    model's processor, for a step engine) and the decoded images.  Refused, before anything is
    decoded, on a backend that does not declare ``vision``."""
    ok, reason = backend.capability("vision")
    if not ok:
        raise RequestError(f"the prompt has {len(values)} image(s), and backend {backend.name!r} cannot read images ({reason}); "
                           "remove them, or serve a vision-language model on a backend that lists vision in `lmdock backends`")
    if not isinstance(text, str):
        raise RequestError("a prompt with multi_modal_data must be text ({'prompt': '...'}), with the model's image "
                           "placeholders where the images go; token-id prompts cannot carry images here")
    data = multimodal_data(values, "multi_modal_data['image']", limits)
    # a step engine's processor expands the placeholders; a request engine (vLLM) runs it itself
    return engine.process_multimodal(text, data, add_special_tokens), data
