"""Tiny random-weight vision-language checkpoints, and test images, for the vision conformance tests.

Each builder makes a transformers model from its config with a fixed seed (weights widened as
:func:`lmdock_conformance.zoo.random_model` does, so greedy choices are not near-ties) and saves it
with a processor made offline: the image processor from its class with explicit sizes, the
tokenizer from stories260K's files with the family's image token added.  Nothing is downloaded.

Images are drawn from a seeded NumPy array (:func:`seeded_image`).  Imports torch, transformers and
PIL inside the functions only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SEED = 43
#: stories260K's vocabulary; the image token is appended after it
VOCAB = 512
#: a chat template that renders transformers' {"type": "image"} parts as the family's placeholder
_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
             "{% for p in m['content'] %}{% if p['type'] == 'image' %}{{ '<image>' }}{% else %}{{ p['text'] }}{% endif %}"
             "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
#: Qwen2-VL's placeholder: its image token between the vision start and end tokens, as Qwen's template writes it
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_TEXT = {"vocab_size": VOCAB + 1, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0, "tie_word_embeddings": False}
#: families the builders make, and the transformers model_type of each
FAMILIES = {"llava": "llava", "idefics3": "idefics3", "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "gemma3": "gemma3"}
#: families built from a transformers release on (their configs, processors and tokenizer
#: attributes as used here); with an earlier transformers FAMILIES leaves them out
SINCE = {"qwen2_vl": (5, 24), "qwen2_5_vl": (5, 24), "gemma3": (5, 24)}


def _transformers_version() -> tuple[int, int]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("transformers").split(".")[:2]
    except PackageNotFoundError:
        return (0, 0)
    return int(major), int(minor)


FAMILIES = {k: v for k, v in FAMILIES.items() if _transformers_version() >= SINCE.get(k, (0, 0))}
#: what a prompt writes where an image goes, per family (the model's processor expands it)
PLACEHOLDERS = {"llava": "<image>", "idefics3": "<image>", "qwen2_vl": _QWEN_IMAGE, "qwen2_5_vl": _QWEN_IMAGE, "gemma3": "<start_of_image>"}
#: Gemma 3's named special tokens (its processor reads them off the tokenizer); the image token at id VOCAB
_GEMMA_TOKENS = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
#: the processor class of the families whose processor is saved and loaded without its video processor
_IMAGES_ONLY = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


def seeded_image(seed: int, size: tuple[int, int] = (40, 30)) -> Any:
    """An RGB PIL image of ``size`` (width, height) from a seeded array."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def build(family: str, target: str | Path, tokenizer: str | Path | None = None, **sizes: Any) -> Path:
    """Build ``family``'s checkpoint and processor into ``target``; returns it.  ``sizes`` (LLaVA
    only, for benchmarks): ``text`` and ``vision`` config overrides, ``image_size`` in pixels."""
    target = Path(target)
    folder = Path(tokenizer or Path(os.environ.get("LMDOCK_MODELS", "../shared/models")) / "stories260K")
    tok = _gemma_tokenizer(folder) if family == "gemma3" else _tokenizer(folder, _QWEN_TOKENS if family in _IMAGES_ONLY else None)
    builders = {"llava": _llava, "idefics3": _idefics3, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3}
    model, processor = builders[family](tok, **sizes)
    model.save_pretrained(target)
    if family in _IMAGES_ONLY:  # its processor holds no video processor (see load_processor): saved by parts
        processor.image_processor.save_pretrained(target)
        (target / "processor_config.json").write_text(f'{{"processor_class": "{_IMAGES_ONLY[family]}"}}')
    else:
        processor.save_pretrained(target)
    tok.save_pretrained(target)
    (target / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}')
    return target


#: Qwen2-VL's special tokens, from VOCAB on: image, video, vision start, vision end
_QWEN_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]


def _tokenizer(folder: Path, tokens: list[str] | None = None) -> Any:
    """stories260K's tokenizer with ``tokens`` added (the first, the image token, at id VOCAB)."""
    from transformers import AutoTokenizer

    tokens = tokens or ["<image>"]
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = _TEMPLATE if tokens[0] == "<image>" else _TEMPLATE.replace("'<image>'", repr(_QWEN_IMAGE))
    assert tok.convert_tokens_to_ids(tokens[0]) == VOCAB  # noqa: S101 - the config's image_token_id
    return tok


def _gemma_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, extra_special_tokens=_GEMMA_TOKENS)
    tok.chat_template = _TEMPLATE.replace("'<image>'", repr(_GEMMA_TOKENS["boi_token"]))
    assert tok.image_token_id == VOCAB  # noqa: S101 - the config's image_token_index
    return tok


def load_processor(path: str | Path) -> Any:
    """The checkpoint's processor, as ``AutoProcessor`` loads it; for Qwen2-VL and Qwen2.5-VL where
    transformers' video processor needs torchvision and it is not installed, the processor without
    it (images only: its image processor, tokenizer and chat template, as transformers' class uses them)."""
    import json

    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except ImportError:
        name = json.loads((Path(path) / "processor_config.json").read_text())["processor_class"]
        if name not in _IMAGES_ONLY.values():
            raise
        tok = transformers.AutoTokenizer.from_pretrained(path)
        return _images_only(getattr(transformers, name))(image_processor=transformers.AutoImageProcessor.from_pretrained(path),
                                                        tokenizer=tok, video_processor=None, chat_template=tok.chat_template)


def _images_only(cls: Any) -> Any:
    """``cls`` (a transformers processor class) taking no video processor."""

    class ImagesOnly(cls):  # type: ignore[misc,valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly


def _widen(model: Any) -> Any:
    """Weights re-drawn from the seed: 2-D std 0.15 (embeddings 1.0), as the text zoo does; the
    output rows of stories260K's 256 byte-fallback tokens (ids 3-258) zeroed, so greedy output is
    whole characters and a server's text can be compared with the reference's decoded text."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim >= 2:
                std = 1.0 if "embed_tokens" in name else 0.15
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        model.lm_head.weight[3:259] = 0.0
    return model.eval()


def _llava(tok: Any, text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None, image_size: int = 28) -> tuple[Any, Any]:
    """LLaVA: a CLIP vision tower (28x28 pixels, 14-pixel patches: 4 features an image), a projector, Llama."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tower = CLIPVisionConfig(**{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                "image_size": image_size, "patch_size": 14, "projection_dim": 32, **(vision or {})})
    cfg = LlavaConfig(vision_config=tower, text_config=LlamaConfig(**{**_TEXT, **(text or {})}), image_token_id=VOCAB, vision_feature_layer=-1,
                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(SEED)
    model = _widen(LlavaForConditionalGeneration(cfg))
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=_TEMPLATE, image_token="<image>")
    return model, processor


def _idefics3(tok: Any) -> tuple[Any, Any]:
    """Idefics3 (SmolVLM's architecture): a SigLIP-style tower over 28-pixel tiles, pixel shuffle, Llama."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>"]})
    text = {**_TEXT, "vocab_size": len(tok)}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}
    cfg = Idefics3Config(vision_config=vision, text_config=text, image_token_id=VOCAB, scale_factor=2)
    torch.manual_seed(SEED)
    model = _widen(Idefics3ForConditionalGeneration(cfg))
    images = Idefics3ImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=1, chat_template=_TEMPLATE)
    return model, processor


def _qwen2_vl(tok: Any) -> tuple[Any, Any]:
    """Qwen2-VL: a ViT over 14-pixel patches merged 2x2 (images resized to 56-84 pixels a side, so
    an image is a grid of 2-3 by 2-3 tokens with 3-D multimodal rotary positions), Qwen2 text."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
    return _qwen(tok, Qwen2VLConfig, Qwen2VLForConditionalGeneration, vision, "qwen2_vl")


def _qwen2_5_vl(tok: Any) -> tuple[Any, Any]:
    """Qwen2.5-VL: Qwen2-VL's layout with a windowed ViT (56-pixel windows, 2 merged tokens a side:
    the 84-pixel images span several; the last block attends fully), RMSNorm and SwiGLU."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2, "window_size": 56,
              "fullatt_block_indexes": [1]}
    return _qwen(tok, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, vision, "qwen2_5_vl")


def _qwen(tok: Any, config: Any, model_class: Any, vision: dict[str, Any], family: str) -> tuple[Any, Any]:
    import torch
    import transformers
    from transformers import Qwen2VLImageProcessor

    text = {k: v for k, v in _TEXT.items() if k != "head_dim"}  # 64 / 2 heads: head_dim 32, 16 rotary pairs
    text.update(vocab_size=len(tok), rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    ids = [tok.convert_tokens_to_ids(t) for t in _QWEN_TOKENS]
    cfg = config(text_config=text, vision_config=vision, image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2],
                 vision_end_token_id=ids[3])
    torch.manual_seed(SEED)
    model = _widen(model_class(cfg))
    images = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=84 * 84)
    processor = _images_only(getattr(transformers, _IMAGES_ONLY[family]))(image_processor=images, tokenizer=tok, video_processor=None,
                                                                          chat_template=tok.chat_template)
    return model, processor


def _gemma3(tok: Any) -> tuple[Any, Any]:
    """Gemma 3: a SigLIP tower over 28-pixel images (7-pixel patches) pooled to 4 tokens an image,
    which attend to each other bidirectionally at prefill; Gemma 3 text with a sliding layer of
    window 8 beside a full one (prompts run past the window), embeddings untied."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    text = {**_TEXT, "vocab_size": len(tok), "sliding_window": 8, "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention"]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 7}
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=tok.image_token_id,
                       boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = _widen(Gemma3ForConditionalGeneration(cfg))
    images = Gemma3ImageProcessor(size={"height": 28, "width": 28})
    return model, Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4, chat_template=tok.chat_template)
