"""Several requests' images through the vision tower in one run.

At the start of a step, the images of every prefill chunk that needs features not yet encoded are
gathered (``lmdock_hf._vision.Vision.encode_step``); where the family's tower inputs concatenate
as transformers itself concatenates a prompt's several images, they run through the tower once and
the features are split back per request by each one's image-token count.  A request whose inputs
do not concatenate with the others' (other keys, other trailing shapes) runs on its own, as before.

Why each concatenation is the per-image computation: LLaVA's CLIP and Gemma 3's SigLIP take a batch
of fixed-size images (``pixel_values [images, 3, H, W]``); Qwen2-VL / Qwen2.5-VL's tower takes all
images' patches in a row with ``image_grid_thw [images, 3]`` and attends within each image (its
``cu_seqlens``, and Qwen2.5-VL's windows, come from the grids); Idefics3 / SmolVLM views
``pixel_values [1, images, 3, H, W]`` as a batch of images (padding images, all zeros, dropped one by
one) with each image's ``pixel_attention_mask``, so images of one height and width join along the
image axis, and others do not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_QWEN = {"pixel_values": 0, "image_grid_thw": 0}
_IDEFICS = {"pixel_values": 1, "pixel_attention_mask": 1}
#: per family, the tower's inputs and the dimension each concatenates along across requests
JOIN: dict[str, dict[str, int]] = {"llava": {"pixel_values": 0}, "gemma3": {"pixel_values": 0}, "qwen2_vl": _QWEN,
                                   "qwen2_5_vl": _QWEN, "idefics3": _IDEFICS, "smolvlm": _IDEFICS}


def groups(family: str, inputs: Sequence[dict[str, Any]]) -> list[list[int]]:
    """The requests (indices into ``inputs``, each one request's tower inputs) that run through the
    tower together: one group per shape signature, and a group of one where they do not concatenate."""
    joined: dict[tuple[Any, ...], list[int]] = {}
    alone: list[list[int]] = []
    for i, x in enumerate(inputs):
        sig = _signature(JOIN.get(family), x)
        if sig is None:
            alone.append([i])
        else:
            joined.setdefault(sig, []).append(i)
    return [*joined.values(), *alone]


def _signature(rule: dict[str, int] | None, x: dict[str, Any]) -> tuple[Any, ...] | None:
    """What must be equal for two requests' inputs to concatenate: every shape but the joined
    dimension, and the dtypes; None where this request's inputs are not the family's known ones."""
    if rule is None or set(x) != set(rule):
        return None
    sig: list[Any] = []
    for key, dim in sorted(rule.items()):
        value = x[key]
        if not isinstance(value, torch.Tensor) or value.dim() <= dim:
            return None
        sig += [key, value.dtype, tuple(n for d, n in enumerate(value.shape) if d != dim)]
    return tuple(sig)


def join(family: str, inputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One tower input from several requests' (one group of :func:`groups`)."""
    if len(inputs) == 1:
        return dict(inputs[0])
    return {key: torch.cat([x[key] for x in inputs], dim) for key, dim in JOIN[family].items()}
