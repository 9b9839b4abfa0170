"""The TOML config file: discovery, ``${env.VAR:-default}`` substitution, validation, JSON Schema.

Discovery order: an explicit path (``--config`` / ``config=``), ``$LMDOCK_CONFIG``, ``./lmdock.toml``,
then ``$XDG_CONFIG_HOME/lmdock/lmdock.toml`` (``~/.config/lmdock/lmdock.toml``).

Relative model paths are resolved against the folder of the file that names them, so a config file
works from any working directory.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmdock._config.model import BuildConfig, KvCacheConfig, ModelConfig, OffloadPolicy, QuantConfig, SchedulerConfig
from lmdock._config.pooling import PoolingParams
from lmdock._config.sampling import SamplingParams
from lmdock._config.schema import FieldError, build, coerce, json_schema, unknown_key
from lmdock._config.server import AUTOSCALING_KEYS, ServerConfig
from lmdock._config.speculative import SpeculativeConfig
from lmdock._plugin.errors import ConfigError

_VAR = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

#: Sections of ``[models.NAME]`` that hold a portable dataclass.
SECTIONS: dict[str, type] = {
    "quantization": QuantConfig,
    "build": BuildConfig,
    "kv_cache": KvCacheConfig,
    "scheduler": SchedulerConfig,
    "offload": OffloadPolicy,
    "pooling": PoolingParams,
    "speculative": SpeculativeConfig,
}
_MODEL_KEYS = {"model", "backend", "fallback", "tokenizer", "revision", "trust_remote_code", "sampling", "backends",
               "keep_alive", "pin", "preload", "tool_parser", "reasoning_parser", "adapters", "replicas", "autoscaling",
               "ray_actor_options"}
#: the keys only ``lmdock serve`` reads (Ray Serve replicas): ``LLM`` runs one engine in its process
SERVE_ONLY_KEYS = ("replicas", "autoscaling", "ray_actor_options")


@dataclass
class ConfigFile:
    """A loaded config file: its models by name."""

    path: str
    models: dict[str, ModelConfig] = field(default_factory=dict)
    default_model: str | None = None
    server: ServerConfig = field(default_factory=ServerConfig)

    def model(self, name: str) -> ModelConfig:
        if name not in self.models:
            known = ", ".join(sorted(self.models)) or "none"
            raise ConfigError(f"no model named {name!r}; models in this file: {known}", source=self.path)
        return self.models[name]


def find_config(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file to use, or None when there is none."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError("config file not found", source=str(path))
        return path
    env = os.environ.get("LMDOCK_CONFIG")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ConfigError("config file named by $LMDOCK_CONFIG not found", source=str(path))
        return path
    local = Path("lmdock.toml")
    if local.is_file():
        return local
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    user = base / "lmdock" / "lmdock.toml"
    return user if user.is_file() else None


def load_config(path: str | os.PathLike[str]) -> ConfigFile:
    """Read and validate a config file; every error names the file and the key path."""
    if sys.version_info >= (3, 11):  # imported here: `import lmdock` stays fast
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    path = Path(path)
    source = str(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=source) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", source=source) from None
    raw = _substitute(raw, source, "")
    unknown = sorted(set(raw) - {"models", "default_model", "server"})
    if unknown:
        raise ConfigError(unknown_key(unknown[0], ("default_model", "models", "server")), source=source, key=unknown[0])
    models = coerce(raw.get("models", {}), dict[str, Any], "models", source)
    cfg = ConfigFile(source, default_model=coerce(raw.get("default_model"), str | None, "default_model", source))
    cfg.server = build(ServerConfig, coerce(raw.get("server", {}), dict[str, Any], "server", source), source=source, prefix="server")
    for name, entry in models.items():
        key = f"models.{name}"
        if not isinstance(entry, dict):
            raise ConfigError("expected a table", source=source, key=key)
        cfg.models[name] = model_config(entry, name=name, source=source, prefix=key, base_dir=path.parent)
    if cfg.default_model is not None and cfg.default_model not in cfg.models:
        raise ConfigError(f"names no model in [models]; known: {', '.join(cfg.models)}", source=source, key="default_model")
    return cfg


def model_config(
    entry: dict[str, Any],
    *,
    name: str | None = None,
    source: str = "<options>",
    prefix: str = "",
    base_dir: Path | None = None,
) -> ModelConfig:
    """Validate one model entry (a ``[models.NAME]`` table, or options passed in code)."""

    def key(k: str) -> str:
        return f"{prefix}.{k}" if prefix else k

    unknown = sorted(set(entry) - _MODEL_KEYS - set(SECTIONS))
    if unknown:
        raise ConfigError(unknown_key(unknown[0], _MODEL_KEYS | set(SECTIONS)), source=source, key=key(unknown[0]))
    if "model" not in entry:
        raise ConfigError("missing required key 'model' (a local path or a hub id)", source=source, key=key("model"))
    kwargs: dict[str, Any] = {"name": name, "source": source}
    kwargs["model"] = _resolve_model(coerce(entry["model"], str, key("model"), source), base_dir, source, key("model"))
    kwargs["backend"] = coerce(entry.get("backend", "auto"), str, key("backend"), source)
    kwargs["fallback"] = coerce(entry.get("fallback", ()), tuple[str, ...], key("fallback"), source)
    for opt in ("tokenizer", "revision"):
        kwargs[opt] = coerce(entry.get(opt), str | None, key(opt), source)
    kwargs["trust_remote_code"] = coerce(entry.get("trust_remote_code", False), bool, key("trust_remote_code"), source)
    kwargs["keep_alive"] = coerce(entry.get("keep_alive", -1), float, key("keep_alive"), source)
    for flag in ("pin", "preload"):
        kwargs[flag] = coerce(entry.get(flag, False), bool, key(flag), source)
    for opt in ("tool_parser", "reasoning_parser"):
        kwargs[opt] = _parser_name(coerce(entry.get(opt), str | None, key(opt), source), opt, source, key(opt))
    for section, cls in SECTIONS.items():
        value = entry.get(section, {})
        # a copy: an editable section (BuildConfig) set later must not reach a loaded model
        kwargs[section] = dataclasses.replace(value) if isinstance(value, cls) else build(cls, coerce(value, dict[str, Any], key(section), source), source=source, prefix=key(section))
    sampling = entry.get("sampling", {})
    if isinstance(sampling, SamplingParams):
        sampling = _explicit_fields(sampling)
    sampling = coerce(sampling, dict[str, Any], key("sampling"), source)
    build(SamplingParams, sampling, source=source, prefix=key("sampling"))  # validate now
    kwargs["sampling"] = sampling
    backends = coerce(entry.get("backends", {}), dict[str, Any], key("backends"), source)
    for bname, opts in backends.items():
        coerce(opts, dict[str, Any], key(f"backends.{bname}"), source)
    kwargs["backends"] = backends
    kwargs["replicas"] = coerce(entry.get("replicas"), int | None, key("replicas"), source)
    for opt in ("autoscaling", "ray_actor_options"):
        kwargs[opt] = coerce(entry.get(opt), dict[str, Any] | None, key(opt), source)
    adapters = coerce(entry.get("adapters", {}), dict[str, str], key("adapters"), source)
    kwargs["adapters"] = {n: _adapter_path(p, base_dir) for n, p in adapters.items()}
    try:
        return ModelConfig(**kwargs)
    except FieldError as exc:
        raise ConfigError(str(exc).split(": ", 1)[1], source=source, key=key(exc.field)) from None


def _parser_name(name: str | None, kind: str, source: str, key: str) -> str | None:
    """A ``tool_parser`` / ``reasoning_parser`` name, checked against the parsers installed."""
    if name is None:
        return None
    from lmdock import tools

    try:
        (tools.get_parser if kind == "tool_parser" else tools.get_reasoning_parser)(name)
    except ConfigError as exc:
        raise ConfigError(str(exc).split(": ", 1)[-1], source=source, key=key) from None
    return name


def _explicit_fields(params: SamplingParams) -> dict[str, Any]:
    default = SamplingParams()
    return {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(default, f.name)
    }


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or os.sep in value and Path(value).exists()


def _adapter_path(value: str, base_dir: Path | None) -> str:
    """A LoRA adapter folder, relative to the config file; not checked here (a request that names a
    missing one fails alone, saying which path)."""
    path = Path(value).expanduser()
    return str(path if path.is_absolute() or base_dir is None else (base_dir / path).resolve())


def _resolve_model(value: str, base_dir: Path | None, source: str, key: str) -> str:
    if not _looks_like_path(value) and not (base_dir is not None and (base_dir / value).exists()):
        return value  # a hub id
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists():
        raise ConfigError(f"model path {str(path)!r} does not exist; fix the path or the variable it uses", source=source, key=key)
    return str(path.resolve())


def _substitute(value: Any, source: str, key: str) -> Any:
    if isinstance(value, dict):
        return {k: _substitute(v, source, f"{key}.{k}" if key else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def repl(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        if var in os.environ:
            return os.environ[var]
        if default is not None:
            return default
        raise ConfigError(
            f"environment variable {var} is not set and has no default; set it or write ${{env.{var}:-DEFAULT}}",
            source=source,
            key=key,
        )

    return _VAR.sub(repl, value)


def _replica_props() -> dict[str, Any]:
    """The schema of the keys that run a model as Ray Serve replicas (``lmdock serve``, ``server/_ray.py``)."""
    number = {"type": "number", "minimum": 0}
    return {
        "replicas": {"type": "integer", "minimum": 1, "description": "lmdock serve: the engine as this many Ray Serve replicas"},
        "autoscaling": {"type": "object", "additionalProperties": False, "required": [],
                        "properties": {k: number for k in ("min", "max", *AUTOSCALING_KEYS)},
                        "description": "lmdock serve: Ray Serve's autoscaler between min and max replicas"},
        "ray_actor_options": {"type": "object", "additionalProperties": False,
                              "properties": {"num_cpus": number, "num_gpus": number, "memory": {"type": "integer", "minimum": 1},
                                             "resources": {"type": "object", "additionalProperties": number},
                                             "accelerator_type": {"type": "string"}},
                              "description": "lmdock serve: each replica's resources (num_cpus 1 unless given)"},
    }


def _with(schema: dict[str, Any], props: dict[str, Any]) -> dict[str, Any]:
    schema["properties"].update(props)
    return schema


def config_schema(backend_options: dict[str, type] | None = None) -> dict[str, Any]:
    """JSON Schema of the config file, with the options of the given backends."""
    model_props: dict[str, Any] = {
        "model": {"type": "string", "description": "a local path (relative to this file) or a hub id"},
        "backend": {"type": "string", "default": "auto"},
        "fallback": {"type": "array", "items": {"type": "string"}},
        "tokenizer": {"type": "string"},
        "revision": {"type": "string"},
        "trust_remote_code": {"type": "boolean", "default": False},
        "tool_parser": {"type": "string", "description": "how the model writes tool calls: hermes, llama3_json, mistral, "
                        "pythonic, or a plugin's (docs/tools.md); default: recognized from the chat template"},
        "reasoning_parser": {"type": "string", "description": "how the model writes its thinking: think (<think>...</think>)"},
        "sampling": json_schema(SamplingParams),
        "keep_alive": {"type": "number", "default": -1, "description": "seconds idle before a server unloads it; 0: when idle; -1: never"},
        "pin": {"type": "boolean", "default": False, "description": "a server loads it at start and never unloads it"},
        "preload": {"type": "boolean", "default": False, "description": "a server loads it at start"},
        "adapters": {"type": "object", "additionalProperties": {"type": "string"},
                     "description": "LoRA adapters by name: PEFT folders (relative to this file); lora_request='NAME'"},
    }
    model_props.update(_replica_props())
    for section, cls in SECTIONS.items():
        model_props[section] = json_schema(cls)
    backends = {name: json_schema(cls) for name, cls in (backend_options or {}).items()}
    model_props["backends"] = {"type": "object", "properties": backends}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "lmdock config file",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "default_model": {"type": "string"},
            "server": _with(json_schema(ServerConfig), _replica_props()),
            "models": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["model"],
                    "additionalProperties": False,
                    "properties": model_props,
                },
            },
        },
    }
