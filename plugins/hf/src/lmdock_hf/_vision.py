"""Images into a transformers vision-language model, over lmdock-hf's slot cache.

The model's own processor (``AutoProcessor``) turns a prompt and its images into token ids, with
each image placeholder expanded to as many image tokens as the vision tower gives features, and
pixel tensors.  At the start of a step, the vision tower runs once over the images of every request
whose prefill chunk needs them, where the family's inputs concatenate (``lmdock_hf._tower``; else
once per request's images); the features are kept by the images' content hashes, so a second turn
over the same images does not run it again.  Each prefill chunk takes the token embeddings of its
ids and puts the image features where its image tokens are, as the model's own forward does with
``masked_scatter``.  The text side then runs as any prompt: slot cache, chunked prefill, continuous
batching.

The families run are LLaVA (CLIP tower, image features in place of ``<image>`` tokens), Idefics3 /
SmolVLM, Qwen2-VL / Qwen2.5-VL, whose multimodal rotary positions ``lmdock_hf._mrope`` carries, and
Gemma 3, whose images attend bidirectionally within their tokens (``lmdock_hf._blocks``).  Others are
refused at load with the reason (:data:`REFUSED`), never run with other tokens than transformers gives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from lmdock import BackendError, RequestError, UnsupportedError

from lmdock_hf import _blocks, _mrope, _tower

#: Vision-language families run exactly (their conformance tests hold them to transformers' generate).
SUPPORTED = {"llava", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "gemma3"}
#: Families refused at load, with why.
REFUSED: dict[str, str] = {}
#: Families run from a transformers release on: the one their conformance tests hold them to (the
#: multimodal position and mask code and the processors differ in earlier releases).
SINCE = {"qwen2_vl": (5, 24), "qwen2_5_vl": (5, 24), "gemma3": (5, 24)}
#: Processor outputs that are the text side (the engine feeds token ids itself).
_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
#: Keys of ``processed`` that are the engine's, not the vision tower's inputs.
_ENGINE_KEYS = {"image_positions", "mrope", "mrope_delta", "blocks", "ids"}
#: Processor classes whose video processor needs torchvision, built without it where it is missing.
_IMAGES_ONLY = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
#: Encoded images kept for later turns (each entry: one request's images, [tokens, hidden]).
_CACHED = 32


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def check_family(config: Any, model: str) -> None:
    """Refuse at load a vision-language family lmdock-hf would run differently from transformers."""
    family = str(config.model_type)
    if family in SINCE and _version() < SINCE[family]:
        import transformers

        raise UnsupportedError(f"{model!r} ({family}): lmdock-hf runs this vision-language family from transformers "
                               f"{'.'.join(map(str, SINCE[family]))} on (its image positions and masks are checked against that "
                               f"release's generate); this is transformers {transformers.__version__}: upgrade transformers")
    if family in SUPPORTED:
        return
    reason = REFUSED.get(family, f"its image inputs are not checked against transformers in lmdock-hf (it runs "
                                 f"{', '.join(sorted(SUPPORTED))})")
    raise UnsupportedError(f"{model!r} ({family}) is a vision-language model lmdock-hf cannot run exactly: {reason}. "
                           "Use lmdock-vllm for it, or a supported family (docs/vision.md)")


class Vision:
    """A loaded vision-language model's image side: its processor and the encoded-image cache."""

    def __init__(self, model: Any, processor: Any) -> None:
        cfg = model.config
        token = getattr(cfg, "image_token_id", None)
        self.image_token_id = int(token if token is not None else cfg.image_token_index)
        self.processor = processor
        self.model = model
        self.family = str(cfg.model_type)
        self.features: OrderedDict[tuple[str, ...], torch.Tensor] = OrderedDict()
        #: how many times the vision tower ran (one run may take several requests' images), for stats and tests
        self.encodes = 0
        # transformers 4.x returns the features themselves and takes no return_dict (a TypeError there)
        self._returns_dict = _is_v5()
        #: the multimodal rotary positions of each sequence (Qwen2-VL), or None
        self.mrope = _mrope.MRope() if cfg.model_type in _mrope.FAMILIES else None
        #: where images attend bidirectionally (Gemma 3): the prefill chunks run on to an image block's end, or None
        self.ahead = _blocks.Ahead() if cfg.model_type in _blocks.FAMILIES else None

    # -- in the submitting thread --------------------------------------------------------------------

    def process(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        """The prompt's ids with each placeholder expanded, as the model's processor makes them;
        ``data.processed`` gets the pixel tensors and where the image tokens are."""
        placeholders = text.count(self._placeholder())
        if placeholders != len(data.images):
            raise RequestError(f"the prompt has {placeholders} image placeholder(s) {self._placeholder()!r} and {len(data.images)} "
                               "image(s): put one placeholder where each image goes (chat does it through the template)")
        try:
            out = self.processor(text=[text], images=data.images, return_tensors="pt", add_special_tokens=add_special_tokens)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"the model's processor refused the images: {exc}") from None
        ids = out["input_ids"][0]
        data.processed = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        data.processed["image_positions"] = (ids == self.image_token_id).nonzero().flatten()
        if self.mrope is not None:
            types = out["mm_token_type_ids"][0] if "mm_token_type_ids" in out else (ids == self.image_token_id).int()
            _mrope.prompt_positions(self.model, ids, data.processed, types)
        if self.ahead is not None:
            data.processed["blocks"] = _blocks.prompt_blocks(ids, self.image_token_id)
            data.processed["ids"] = ids.tolist()
        return ids.tolist()

    def _placeholder(self) -> str:
        token = getattr(self.processor, "image_token", None)
        return str(token) if token else str(self.processor.tokenizer.convert_ids_to_tokens(self.image_token_id))

    # -- in the engine thread ----------------------------------------------------------------------

    def embeds(self, chunk: Any, ids: torch.Tensor) -> torch.Tensor:
        """``[1, width, hidden]``: the chunk's token embeddings, image features where its image tokens are."""
        embeds = self.model.get_input_embeddings()(ids)
        here = ids[0] == self.image_token_id
        if not bool(here.any()):
            return embeds
        data = chunk.multi_modal
        features = self._encoded(data)
        before = int((data.processed["image_positions"] < chunk.start).sum())
        rows = features[before : before + int(here.sum())].to(embeds.dtype)
        embeds = embeds.clone()
        embeds[0, here] = rows
        return embeds

    def encode_step(self, chunks: Sequence[Any]) -> None:
        """Before a step's forwards: the images of every chunk that holds image tokens and whose
        request's features are not kept, through the tower in as few runs as the family's inputs
        allow (``lmdock_hf._tower``).  At most :data:`_CACHED` requests, so none is evicted before its forward."""
        waiting: dict[tuple[str, ...], Any] = {}
        for c in chunks:
            data = c.multi_modal
            if data is not None and data.key not in self.features and _holds_images(c) and len(waiting) < _CACHED:
                waiting.setdefault(data.key, data)
        requests = list(waiting.values())
        inputs = [self._inputs(data) for data in requests]
        for group in _tower.groups(self.family, inputs):
            self._encode([requests[i] for i in group], [inputs[i] for i in group])

    def _encoded(self, data: Any) -> torch.Tensor:
        """All the request's image features, ``[image tokens, hidden]``, from the cache or the tower."""
        found = self.features.get(data.key)
        if found is not None:
            self.features.move_to_end(data.key)
            return found
        return self._encode([data], [self._inputs(data)])[0]

    def _inputs(self, data: Any) -> dict[str, Any]:
        return {k: v for k, v in data.processed.items() if k not in _ENGINE_KEYS}

    def _encode(self, requests: list[Any], inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One tower run over the requests' images; each request's features, kept by its key."""
        joined = {k: _on(v, self.model) for k, v in _tower.join(self.family, inputs).items()}
        if self._returns_dict:  # transformers 5: a ModelOutput whose pooler_output holds the features
            joined["return_dict"] = True
        out = self.model.get_image_features(**joined)
        feats = getattr(out, "pooler_output", out)
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats]) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1])
        want = [len(data.processed["image_positions"]) for data in requests]
        if feats.shape[0] != sum(want):
            raise BackendError(f"the vision tower gave {feats.shape[0]} image features for {sum(want)} image tokens")
        self.encodes += 1
        # a request's own copy where several share the run: a kept view would hold all their features
        split = list(torch.split(feats, want)) if len(requests) == 1 else [f.clone() for f in torch.split(feats, want)]
        for data, mine in zip(requests, split):
            self.features[data.key] = mine
        while len(self.features) > _CACHED:
            self.features.popitem(last=False)
        return split


def _holds_images(chunk: Any) -> bool:
    """Whether the chunk's positions take any of its prompt's image tokens."""
    where = chunk.multi_modal.processed["image_positions"]
    return bool(((where >= chunk.start) & (where < chunk.start + len(chunk.token_ids))).any())


def _is_v5() -> bool:
    return _version() >= (5, 0)


def _version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def _on(value: Any, model: Any) -> Any:
    """A processor tensor on the model's device; floating pixels in the model's dtype."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.to(model.device)
    return value.to(model.dtype) if value.is_floating_point() else value


def load(model: Any, mc: Any) -> Vision:
    from transformers import AutoProcessor

    where = {"trust_remote_code": mc.trust_remote_code, "revision": mc.revision}
    try:
        try:
            processor = AutoProcessor.from_pretrained(mc.tokenizer or mc.model, **where)
        except ImportError:  # a video processor that needs torchvision; lmdock reads images only
            if model.config.model_type not in _IMAGES_ONLY:
                raise
            processor = _images_only(model.config.model_type, mc.tokenizer or mc.model, where)
    except (OSError, ValueError, ImportError) as exc:
        raise BackendError(f"lmdock-hf could not load the image processor of {mc.model!r}: {exc}") from exc
    return Vision(model, processor)


def _images_only(family: str, folder: str, where: dict[str, Any]) -> Any:
    """The family's processor class over its image processor and tokenizer, without a video processor."""
    import transformers

    cls = getattr(transformers, _IMAGES_ONLY[family])

    class ImagesOnly(cls):  # type: ignore[misc,valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    tok = transformers.AutoTokenizer.from_pretrained(folder, **where)
    images = transformers.AutoImageProcessor.from_pretrained(folder, **where)
    return ImagesOnly(image_processor=images, tokenizer=tok, video_processor=None, chat_template=tok.chat_template)
