"""Resolving a model (config-file name, path or hub id, plus overrides) and loading its engine: backend
selection with fallbacks and ``auto``, option validation, the quantization and build-config hooks, and
wrapping a step engine into the core's loop."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from lmdock._config.file import SECTIONS, ConfigFile, find_config, load_config, model_config
from lmdock._config.model import ModelConfig
from lmdock._config.sampling import SamplingParams
from lmdock._config.schema import build
from lmdock._plugin.contract import BackendSpec, RequestEngine
from lmdock._plugin.errors import BackendError, ConfigError, LmdockError, RequestError, UnsupportedError


def resolve_model(model: str | os.PathLike[str] | None, config: str | os.PathLike[str] | None, options: dict[str, Any]) -> ModelConfig:
    """Turn ``LLM(model, config=..., **options)`` into one validated :class:`ModelConfig`."""
    path = find_config(config)
    cfg: ConfigFile | None = load_config(path) if path is not None else None
    name = str(model) if model is not None else None
    if cfg is not None and (name is None or name in cfg.models):
        if name is None:
            name = cfg.default_model or (next(iter(cfg.models)) if len(cfg.models) == 1 else None)
            if name is None:
                raise ConfigError("several models and no default_model: name one", source=cfg.path)
        return _overlay(cfg.model(name), options)
    if name is None:
        raise ConfigError("no model given and no config file found (looked for --config, $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    _check_not_a_typo(name, cfg)
    return model_config({"model": name, **options}, source="<options>", base_dir=Path.cwd())


def _check_not_a_typo(name: str, cfg: ConfigFile | None) -> None:
    """A name in neither the config file nor on disk must not go to the hub as a guess: a bare word
    with a config file around is a config name the user mistyped (hub ids are ``org/name``)."""
    if Path(name).expanduser().exists():
        return
    if cfg is not None and "/" not in name:
        import difflib

        close = difflib.get_close_matches(name, list(cfg.models), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"no model named {name!r} in the config file, and no such path; {hint}models in the config: "
            f"{', '.join(cfg.models) or 'none'}. Give one of them, a local path, or a hub id (org/name)",
            source=cfg.path,
        )


def _overlay(base: ModelConfig, options: dict[str, Any]) -> ModelConfig:
    """The config file's entry with ``LLM(...)`` options over it, validated like the file itself: a
    section given as a dict overrides the entry's fields one by one."""
    if not options:
        return base
    allowed = {"model", "backend", "fallback", "tokenizer", "revision", "trust_remote_code", "tool_parser", "reasoning_parser",
               "sampling", "backends", *SECTIONS}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}", source="<options>", key=unknown[0])
    scalars = ("model", "backend", "fallback", "tokenizer", "revision", "trust_remote_code", "tool_parser", "reasoning_parser")
    entry: dict[str, Any] = {k: getattr(base, k) for k in scalars}
    for section in SECTIONS:
        current = getattr(base, section)
        value = options.get(section)
        if isinstance(value, dict):
            fields = {f.name: getattr(current, f.name) for f in dataclasses.fields(current) if f.init}
            entry[section] = {**fields, **value}
        else:
            entry[section] = value or current
    entry["sampling"] = {**base.sampling, **sampling_dict(options.get("sampling", {}))}
    # each backend's table field by field, as the sections (enforce_eager=True beside the file's [backends.vllm])
    given = options.get("backends", {})
    entry["backends"] = {**base.backends, **{k: {**base.backends.get(k, {}), **v} if isinstance(v, dict) else v for k, v in given.items()}}
    for key in scalars:
        if key in options:
            entry[key] = options[key]
    return model_config(entry, name=base.name, source="<options>", base_dir=Path.cwd())


def load_engine(mc: ModelConfig) -> tuple[RequestEngine, BackendSpec]:
    """Select the backend (with fallbacks and ``auto``), translate the config, load the engine."""
    from lmdock._plugin.manager import get_registry
    from lmdock._plugin.versions import warn_if_out_of_range

    registry = get_registry()
    candidates = _candidates(mc, registry)
    failures: list[tuple[str, LmdockError]] = []
    for name in candidates:
        try:
            spec = registry.backend(name)
            reason = spec.available()
            if reason:
                raise BackendError(f"backend {name!r} is not available here: {reason}")
            warn_if_out_of_range(spec)  # before loading: the warning explains a failure the engine may raise
            engine = _load_one(spec, mc, registry)
        except ConfigError:
            raise  # the user's options are wrong: no fallback hides that
        except LmdockError as exc:
            failures.append((name, exc))
            continue
        if engine is not None:
            return engine, spec
        failures.append((name, BackendError(f"backend {name!r} declined model {mc.model!r}")))
    if len(failures) == 1:
        raise failures[0][1]
    detail = "; ".join(f"{n}: {e}" for n, e in failures) or "no backend is installed (pip install lmdock-hf)"
    raise BackendError(f"no backend could load {mc.model!r}: {detail}")


def _candidates(mc: ModelConfig, registry: Any) -> list[str]:
    """The backends to try in order: the named one and its fallbacks, ``auto`` expanded to the
    available backends that load the model's format, by priority."""
    from lmdock._plugin.contract import model_format

    fmt = model_format(mc.model)
    names: list[str] = []
    for name in (mc.backend, *mc.fallback):
        if name == "auto":
            ranked = sorted(registry.backends.values(), key=lambda s: -s.priority)
            if not ranked:
                raise BackendError("backend 'auto': no backend is installed; pip install lmdock-hf (or lmdock-onnx, lmdock-mlx, lmdock-vllm)")
            names += [s.name for s in ranked if fmt in s.model_formats and s.available() is None and s.name not in names]
        elif name not in names:
            names.append(name)
    _check_format(mc, fmt, names, registry)
    return names


def _check_format(mc: ModelConfig, fmt: str, names: list[str], registry: Any) -> None:
    """Refuse, before any loading, a model whose format none of the candidates reads."""
    from lmdock._plugin.contract import MODEL_FORMATS

    specs = [registry.backends[n] for n in names if n in registry.backends]
    if any(fmt in s.model_formats for s in specs) or len(specs) < len(names):
        return  # one can read it, or one is not installed (loading it says what to pip install)
    what, package = MODEL_FORMATS[fmt]
    readers = sorted(s.name for s in registry.backends.values() if fmt in s.model_formats)
    tried = f"backend {', '.join(repr(n) for n in names)} does not" if names else "no installed backend can"
    fix = f"use backend = {readers[0]!r}" if readers else f"pip install {package}"
    raise BackendError(f"{mc.model!r} is {what}; {tried} load that: {fix}")


def _load_one(spec: BackendSpec, mc: ModelConfig, registry: Any) -> RequestEngine | None:
    hook = registry.hook()
    prefix = f"models.{mc.name}.backends.{spec.name}" if mc.name else f"backends.{spec.name}"
    raw = mc.backend_options(spec.name)
    options = build(spec.options, raw, source=mc.source, prefix=prefix) if spec.options else raw
    quant = None
    if mc.quantization.enabled:
        quant = hook.lmdock_translate_quantization(backend=spec.name, quant=mc.quantization, model_config=mc)
        if quant is None:
            raise UnsupportedError(f"backend {spec.name!r} cannot quantize ({mc.quantization.algo!r}); remove [quantization] or pick another backend")
    _check_lora_limits(spec, mc)
    build_args = hook.lmdock_translate_build_config(backend=spec.name, model_config=mc) or {}
    engine = hook.lmdock_load_engine(backend=spec.name, model_config=mc, options=options, quantization=quant, build=build_args)
    if engine is None:
        return engine
    from lmdock._engine.adapters import as_request_engine, engine_kind

    kind = engine_kind(engine, spec.kind)  # declared on its class (lmdock.backend's bases), else told once
    if kind == "pooling":  # an embedding model or a cross-encoder, from a step or a request backend alike
        from lmdock._engine.pooling import PoolingRunner

        return PoolingRunner(engine, max_num_seqs=mc.scheduler.max_num_seqs, max_num_batched_tokens=mc.scheduler.max_num_batched_tokens)
    if kind == "request":
        return as_request_engine(engine)
    return _wrap_step_engine(engine, spec, mc, hook)


def _check_lora_limits(spec: BackendSpec, mc: ModelConfig) -> None:
    """``build.max_loras`` / ``max_lora_rank`` and declared adapters on a backend that cannot run
    adapters are refused, not ignored."""
    asked = [f"build.{k}" for k in ("max_loras", "max_lora_rank") if getattr(mc.build, k) is not None]
    asked += ["[models.NAME.adapters]"] if mc.adapters else []
    ok, reason = spec.capability("lora")
    if asked and not ok:
        raise UnsupportedError(f"{' and '.join(asked)}: backend {spec.name!r} cannot run LoRA adapters ({reason}); "
                               "remove it, or pick a backend that lists lora in `lmdock backends`")


def _wrap_step_engine(engine: Any, spec: BackendSpec, mc: ModelConfig, hook: Any) -> RequestEngine:
    from lmdock._engine.adapters import as_step_engine
    from lmdock._engine.runner import StepRunner

    engine = as_step_engine(engine)
    # an engine may narrow the scheduler's limits (lmdock-hf's OffloadPolicy picks the batch it streams for)
    config = mc.scheduler.replace(**limits) if (limits := engine.scheduler_limits) else mc.scheduler
    scheduler = hook.lmdock_make_scheduler(config=config, max_seq_len=engine.max_seq_len, kv_capacity_tokens=engine.kv_capacity_tokens)
    if scheduler is None:
        engine.close()
        raise ConfigError(f"no plugin provides scheduling policy {mc.scheduler.policy!r}", source=mc.source, key="scheduler.policy")
    sampler = hook.lmdock_make_sampler(backend=spec.name, model_config=mc)

    def processors_for(params: SamplingParams) -> list[Any]:
        out: list[Any] = []
        for impl in _in_registration_order(hook.lmdock_logits_processors.get_hookimpls()):
            try:
                group = impl.function(params=params)
            except Exception as exc:
                raise RequestError(f"plugin {impl.plugin_name!r}: lmdock_logits_processors failed: {type(exc).__name__}: {exc}") from exc
            out += [named_processor(proc, impl.plugin_name) for proc in group or ()]
        # the request's own (vLLM's per-request logits_processors), after the plugins'
        return out + [named_processor(proc, "<request>") for proc in params.logits_processors]

    make_constraints = hook.lmdock_make_constraints(backend=spec.name, model_config=mc, tokenizer=engine.tokenizer, vocab_size=engine.vocab_size, eos_token_ids=tuple(engine.eos_token_ids))
    # fill_masks: a whole batch's masks at once, where the constraint stage has it
    return StepRunner(engine, scheduler, sampler, processors_for, constraints_for=make_constraints,
                      prefix_caching=mc.kv_cache.enable_prefix_caching, async_output=mc.scheduler.async_output,
                      fill_masks=getattr(make_constraints, "fill_masks", None), speculative=_proposer(engine, mc, hook))


def _proposer(engine: Any, mc: ModelConfig, hook: Any) -> tuple[Any, Any] | None:
    """``[speculative]``: the config and the proposer a plugin answers with; a method none answers
    for is refused (the engine is closed first)."""
    config = mc.speculative
    if not config.enabled:
        return None
    try:
        proposer = hook.lmdock_speculative_proposer(config=config, engine=engine, model_config=mc)
    except BaseException:
        engine.close()
        raise
    if proposer is None:
        engine.close()
        raise ConfigError(f"no plugin proposes with speculative method {config.method!r}; use 'ngram' or 'draft' "
                          "(or install the plugin that provides it)", source=mc.source, key="speculative.method")
    return config, proposer


def load_draft_engine(config: Any, target: Any, mc: ModelConfig) -> Any:
    """The draft model of ``method = "draft"`` as a step engine (the target's backend unless
    ``speculative.backend`` names one), refused unless it shares the target's vocabulary."""
    from lmdock._plugin.manager import get_registry

    registry = get_registry()
    dmc = ModelConfig(model=config.model, backend=config.backend or mc.backend, build=mc.build, source=mc.source)
    names = _candidates(dmc, registry)
    spec = registry.backend(names[0])
    if spec.kind != "step":
        raise ConfigError(f"the draft model needs a step backend; {spec.name!r} is a request engine", source=mc.source, key="speculative.backend")
    hook = registry.hook()
    options = build(spec.options, {}, source=mc.source) if spec.options else {}
    build_args = hook.lmdock_translate_build_config(backend=spec.name, model_config=dmc) or {}
    draft = hook.lmdock_load_engine(backend=spec.name, model_config=dmc, options=options, quantization=None, build=build_args)
    from lmdock._engine.adapters import engine_kind

    if draft is None or engine_kind(draft, spec.kind) != "step":
        raise ConfigError(f"backend {spec.name!r} could not load the draft model {config.model!r} as a step engine", source=mc.source, key="speculative.model")
    if draft.vocab_size != target.vocab_size or tuple(draft.eos_token_ids) != tuple(target.eos_token_ids):
        draft.close()
        raise ConfigError(f"the draft model {config.model!r} does not share the target's vocabulary (vocab {draft.vocab_size} vs "
                          f"{target.vocab_size}, eos {tuple(draft.eos_token_ids)} vs {tuple(target.eos_token_ids)})",
                          source=mc.source, key="speculative.model")
    return draft


def sampling_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, SamplingParams):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return dict(value)


def _in_registration_order(impls: list[Any]) -> list[Any]:
    """Hook implementations in the order the docs promise: ``tryfirst`` ones, then the rest in plugin
    registration order, then ``trylast`` ones (pluggy itself calls them last-registered first)."""
    return sorted(impls, key=lambda i: 0 if i.tryfirst else (2 if i.trylast else 1))


def named_processor(proc: Any, plugin: str) -> Any:
    """Wrap a logits processor so its failure names it and its plugin (and fails its request alone)."""
    name = getattr(proc, "__qualname__", None) or type(proc).__name__

    def run(token_ids: list[int], logits: Any) -> Any:
        try:
            return proc(token_ids, logits)
        except Exception as exc:
            raise RequestError(f"logits processor {name!r} of plugin {plugin!r} failed: {type(exc).__name__}: {exc}") from exc

    run.plugin = plugin  # type: ignore[attr-defined]
    run.__qualname__ = name
    return run
