"""Images in served requests (docs/vision.md): the ``[server]`` bounds they are decoded under.  The
chat call (``lmdock._llm.chat.ChatCall``) takes the image parts out of the messages before the
template renders them and carries them to ``LLM.make_request`` (``lmdock._llm.multimodal``)."""

from __future__ import annotations

from typing import Any

from lmdock._llm.multimodal import ImageLimits
from lmdock.server._fetch import Fetcher


def limits(settings: Any) -> ImageLimits:
    """``[server]``'s image bounds: a file path only under ``image_dir``, none without it; http(s)
    URLs fetched only with ``image_fetch`` on, under its bounds (``_fetch.py``)."""
    return ImageLimits(max_pixels=settings.max_image_pixels, max_images=settings.max_images_per_request,
                       image_dir=settings.image_dir, allow_paths=settings.image_dir is not None,
                       fetch=Fetcher.from_settings(settings) if settings.image_fetch else None)

