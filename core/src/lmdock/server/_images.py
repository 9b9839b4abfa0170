"""Images in served chat requests (docs/vision.md): image parts out of the messages before the
template renders them, the prompt that carries them to ``LLM.make_request``, and the ``[server]``
bounds they are decoded under (``lmdock._multimodal``)."""

from __future__ import annotations

from typing import Any

from lmdock._multimodal import ImageLimits, chat_images, processor_adds_special_tokens


def limits(settings: Any) -> ImageLimits:
    """``[server]``'s image bounds: a file path only under ``image_dir``, none without it."""
    return ImageLimits(max_pixels=settings.max_image_pixels, max_images=settings.max_images_per_request,
                       image_dir=settings.image_dir, allow_paths=settings.image_dir is not None)


def split(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages with image parts as ``{"type": "image"}`` (the template's placeholder), and the images."""
    return chat_images(messages)


def prompt(text: str, images: list[Any]) -> str | dict[str, Any]:
    """The rendered prompt, with its images as vLLM's ``multi_modal_data`` when it has any."""
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def text_of(prompt: str | dict[str, Any]) -> str:
    return prompt["prompt"] if isinstance(prompt, dict) else prompt


def special_tokens(prompt: str | dict[str, Any], tokenizer: Any) -> bool:
    """Whether the rendered chat prompt gets the tokenizer's special tokens: never for text (the
    template writes them); with images, as transformers' processors decide."""
    return isinstance(prompt, dict) and processor_adds_special_tokens(prompt["prompt"], tokenizer)
