"""A backend plugin declared in one object: its spec and the functions that do its work.

simonw/llm's plugins hand over an object that carries its own behaviour; hooks are for what plugins
compete over.  ``Backend`` is that object for lmdock: its hookimpls answer only for their own
backend's name, refuse what the spec says the backend lacks before any work is done, and call the
plugin's functions, which therefore never check which backend a call is for.  Probes that several
plugins need (:func:`has_nvidia_gpu`) live here too, once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

from lmdock._config.model import ModelConfig, QuantConfig
from lmdock._plugin.contract import BackendSpec
from lmdock._plugin.errors import UnsupportedError
from lmdock._plugin.markers import hookimpl

Load = Callable[[ModelConfig, Any, Any, dict[str, Any]], Any]
Build = Callable[[ModelConfig], "dict[str, Any] | None"]
Quantize = Callable[[QuantConfig, ModelConfig], Any]


class Backend:
    """Register a backend: ``plugin = Backend(SPEC, load=..., build=..., quantize=...)`` in the entry
    module, and name it in the entry point (``[project.entry-points.lmdock] NAME = "module:plugin"``).

    * ``load(model_config, options, quantization, build)`` builds the engine (``lmdock_load_engine``);
      ``quantization`` is what ``quantize`` returned (None without ``[quantization]``), ``build``
      what ``build`` returned (``{}`` without it).
    * ``build(model_config)`` translates the portable build limits (``lmdock_translate_build_config``).
    * ``quantize(quant, model_config)`` translates or refuses a ``QuantConfig``
      (``lmdock_translate_quantization``); without it, every ``[quantization]`` is refused.
    * ``parallel``: whether the engine spreads one model over several devices itself; without it a
      ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1 is refused.
    * ``sampler(model_config)`` makes a native sampler (``lmdock_make_sampler``) of the reference
      sampler's semantics, for an engine whose logits live on a device; None declines (the reference).

    ``[offload]`` is refused with the spec's own reason where the spec lacks ``"offload"``.
    """

    def __init__(self, spec: BackendSpec, *, load: Load, build: Build | None = None, quantize: Quantize | None = None, parallel: bool = False,
                 sampler: Callable[[ModelConfig], Any] | None = None) -> None:
        self.spec = spec
        self.load = load
        self.build = build
        self.quantize = quantize
        self.parallel = parallel
        self.sampler = sampler

    def __repr__(self) -> str:
        return f"Backend({self.spec.name!r})"

    @hookimpl
    def lmdock_register_backends(self, register: Callable[[BackendSpec], None]) -> None:
        register(self.spec)

    @hookimpl
    def lmdock_translate_quantization(self, backend: str, quant: QuantConfig, model_config: ModelConfig) -> Any:
        if backend != self.spec.name or self.quantize is None:
            return None
        return self.quantize(quant, model_config)

    @hookimpl
    def lmdock_translate_build_config(self, backend: str, model_config: ModelConfig) -> dict[str, Any] | None:
        if backend != self.spec.name:
            return None
        self._refuse_what_the_spec_lacks(model_config)
        return self.build(model_config) if self.build is not None else None

    @hookimpl
    def lmdock_load_engine(self, backend: str, model_config: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
        if backend != self.spec.name:
            return None
        return self.load(model_config, options, quantization, build)

    @hookimpl
    def lmdock_make_sampler(self, backend: str, model_config: ModelConfig) -> Any:
        if backend != self.spec.name or self.sampler is None:
            return None
        return self.sampler(model_config)

    def _refuse_what_the_spec_lacks(self, mc: ModelConfig) -> None:
        who = self.spec.package or f"backend {self.spec.name!r}"
        b = mc.build
        if not self.parallel and (b.tensor_parallel_size > 1 or b.pipeline_parallel_size > 1):
            raise UnsupportedError(
                f"{who} runs one model on one device; tensor_parallel_size / pipeline_parallel_size above 1 "
                "need a backend that spreads a model over devices (lmdock-vllm, lmdock-trtllm)"
            )
        has_offload, why = self.spec.capability("offload")
        if mc.offload.enabled and not has_offload:
            raise UnsupportedError(f"{who} does not offload weights ({why}); remove [offload]")
        refuse_unsupported_family(self.spec, mc.model, mc.build.max_seq_len)


def refuse_unsupported_family(spec: BackendSpec, model: str, max_seq_len: int | None = None) -> None:
    """Raise UnsupportedError before loading when ``model`` needs a feature (lmdock._plugin.families) that
    ``spec`` lacks, or is of a family ``spec`` refuses.  A model whose config cannot be read here (a
    hub id not in the cache) is left to the engine.  A context capped at the model's sliding window
    (``build.max_seq_len``) needs no window: every engine caps its sequences there."""
    from lmdock._plugin.families import model_features

    found = model_features(model)
    if found is not None and (why := family_refusal(spec, found.within(max_seq_len), model)):
        raise UnsupportedError(why)


def family_refusal(spec: BackendSpec, found: Any, model: str) -> str | None:
    """Why ``spec`` refuses a model with these features (lmdock._plugin.families.ModelFeatures), naming the
    family, what is missing, the backend's reason and the installed backends that have it; None
    when it runs it."""
    who = spec.package or f"backend {spec.name!r}"
    family = found.model_type
    if family in spec.refuses_families:
        return (f"{model!r} is a {family} model, which {who} refuses: {spec.refuses_families[family]}; "
                f"{_instead(spec, found.features, family, model)}")
    for feature, detail in found.features.items():
        ok, why = spec.capability(feature, family)
        if not ok:
            cap = (f"; or cap the context at the window (build.max_seq_len = {found.window} or less), which then never cuts it"
                   if feature == "sliding_window" and found.window else "")
            return (f"{model!r} is a {family} model with {detail}; {who} lacks {feature!r}: {why}; "
                    f"{_instead(spec, found.features, family, model)}{cap}")
    return None


def _instead(spec: BackendSpec, features: Any, family: str, model: str) -> str:
    """What to use instead: the installed backends that read this format and have every feature."""
    from lmdock._plugin.contract import model_format
    from lmdock._plugin.manager import get_registry

    fmt = model_format(model)
    fits = [s.name for s in get_registry().backends.values()
            if s.name != spec.name and fmt in s.model_formats and family not in s.refuses_families and all(s.capability(f, family)[0] for f in features)]
    if fits:
        return "use " + " or ".join(f"backend = {n!r}" for n in sorted(fits))
    hint = "" if spec.name == "hf" else " (lmdock-hf runs every family)"
    return f"use a backend that lists {', '.join(features) or family} in `lmdock backends`{hint}"


def has_nvidia_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU, from the device node or ``nvidia-smi`` alone (no import,
    no driver call): cheap enough for ``BackendSpec.available`` and ``has_hardware`` probes."""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
