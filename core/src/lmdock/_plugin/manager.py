"""The plugin manager: created on first use, never at import.

Entry points in the ``lmdock`` group are loaded lazily and one at a time: a plugin that fails to
import or to register is recorded with its error, and the others keep working (vLLM #48277 is what
happens when such failures are swallowed; llm-replicate #26 when they are not contained).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import threading
from dataclasses import dataclass
from typing import Any

import pluggy

from lmdock import hookspecs
from lmdock._plugin.contract import PLUGIN_API_VERSION, BackendSpec
from lmdock._plugin.errors import BackendError, PluginError

ENTRY_POINT_GROUP = "lmdock"

#: First-party backends and the distribution that provides each, for "pip install ..." hints.
FIRST_PARTY_PACKAGES = {
    "hf": "lmdock-hf",
    "onnx": "lmdock-onnx",
    "mlx": "lmdock-mlx",
    "vllm": "lmdock-vllm",
    "trtllm": "lmdock-trtllm",
}


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that could not be loaded or registered, and why."""

    name: str
    distribution: str | None
    error: str


class Registry:
    """The plugin manager and what the plugins declared."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("lmdock")
        self.pm.add_hookspecs(hookspecs)
        self.backends: dict[str, BackendSpec] = {}
        self.broken: dict[str, BrokenPlugin] = {}

    # -- loading ---------------------------------------------------------------------------------

    def add_plugin(self, plugin: Any, name: str, distribution: str | None = None) -> None:
        """Register ``plugin`` (a module or object with hookimpls) and collect its backends."""
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation errors name the offending hook
            self.broken[name] = BrokenPlugin(name, distribution, f"{type(exc).__name__}: {exc}")
            return
        impl = next(
            (i for i in self.pm.hook.lmdock_register_backends.get_hookimpls() if i.plugin is plugin), None
        )
        if impl is None:
            return
        specs: list[BackendSpec] = []
        try:
            impl.function(register=specs.append)
            for spec in specs:
                _check_api(spec, name)
        except Exception as exc:
            self.pm.unregister(plugin)
            self.broken[name] = BrokenPlugin(name, distribution, f"{type(exc).__name__}: {exc}")
            return
        for spec in specs:
            first = self.backends.get(spec.name)
            if first is not None and first.plugin != name:
                # the first registration wins; the clash is reported, never silently resolved
                self.broken[f"{name}:{spec.name}"] = BrokenPlugin(
                    name,
                    distribution,
                    f"declares backend {spec.name!r}, which plugin {first.plugin!r}"
                    + (f" (from {first.package})" if first.package else "")
                    + " already registered; uninstall one of them or rename the backend",
                )
                continue
            version = spec.version or _dist_version(distribution)
            self.backends[spec.name] = dataclasses.replace(
                spec, plugin=name, package=spec.package or distribution, version=version
            )

    def load_entry_points(self) -> None:
        if os.environ.get("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0"):
            return
        allow = _allow_list()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            if ep.name in self.broken or self.pm.has_plugin(ep.name):
                continue
            dist = ep.dist.name if ep.dist is not None else None
            try:
                plugin = ep.load()
            except Exception as exc:
                self.broken[ep.name] = BrokenPlugin(ep.name, dist, f"{type(exc).__name__}: {exc}")
                continue
            self.add_plugin(plugin, ep.name, dist)

    # -- lookup ----------------------------------------------------------------------------------

    def backend(self, name: str) -> BackendSpec:
        """The spec of backend ``name``; a clear error if it is unknown or its plugin is broken."""
        if name in self.backends:
            return self.backends[name]
        if name in self.broken:
            b = self.broken[name]
            raise PluginError(
                f"backend {name!r}: plugin {b.name!r}"
                + (f" (from {b.distribution})" if b.distribution else "")
                + f" failed to load: {b.error}. Reinstall or fix it; `lmdock backends` lists its state."
            )
        raise BackendError(unknown_backend_message(name, self))

    def hook(self) -> Any:
        return self.pm.hook


def unknown_backend_message(name: str, registry: Registry) -> str:
    installed = ", ".join(f"{s.name} ({s.package or s.plugin})" for s in registry.backends.values())
    package = FIRST_PARTY_PACKAGES.get(name, f"a plugin that provides {name!r}")
    msg = f"unknown backend {name!r}; installed backends: {installed or 'none'}."
    msg += f" To use {name!r}, pip install {package}."
    if os.environ.get("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0"):
        msg += " (Plugin autoloading is off: LMDOCK_DISABLE_PLUGIN_AUTOLOAD is set.)"
    elif _allow_list() is not None:
        msg += f" (Only plugins in LMDOCK_PLUGINS={os.environ['LMDOCK_PLUGINS']} are loaded"
        msg += f"; installed plugins: {', '.join(installed_plugin_names()) or 'none'}.)"
    return msg


def installed_plugin_names() -> list[str]:
    """The names of every installed ``lmdock`` entry point, loaded or not."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def plugin_filter_note() -> str | None:
    """Why installed plugins were not loaded (LMDOCK_PLUGINS / LMDOCK_DISABLE_PLUGIN_AUTOLOAD), or None."""
    installed = installed_plugin_names()
    if os.environ.get("LMDOCK_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0"):
        if not installed:
            return None
        return (f"LMDOCK_DISABLE_PLUGIN_AUTOLOAD is set, so the installed plugins ({', '.join(installed)}) "
                "were not loaded; unset it to use them")
    allow = _allow_list()
    if allow is None:
        return None
    missing = sorted(allow - set(installed))
    if not missing:
        return None
    return (f"LMDOCK_PLUGINS={os.environ['LMDOCK_PLUGINS']} names {', '.join(repr(m) for m in missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed; installed plugins: {', '.join(installed) or 'none'}. "
            "LMDOCK_PLUGINS is a comma-separated list of plugin names to load; unset it to load them all")


def _check_api(spec: BackendSpec, plugin: str) -> None:
    want = PLUGIN_API_VERSION.split(".")[0]
    got = str(spec.plugin_api).split(".")[0]
    if want != got:
        raise PluginError(
            f"plugin {plugin!r} declares backend {spec.name!r} for plugin API {spec.plugin_api}, "
            f"but this lmdock implements {PLUGIN_API_VERSION}; install a release of the plugin "
            f"written for API {want}.x, or an lmdock that implements {spec.plugin_api}."
        )


def _allow_list() -> set[str] | None:
    raw = os.environ.get("LMDOCK_PLUGINS")
    if raw is None or not raw.strip():
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _dist_version(distribution: str | None) -> str | None:
    if not distribution:
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


_registry: Registry | None = None
_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, created (built-ins, then entry points) on first call."""
    global _registry
    with _lock:
        if _registry is None:
            from lmdock._plugin import builtin as _builtin

            registry = Registry()
            registry.add_plugin(_builtin, "lmdock-builtin", "lmdock")
            registry.load_entry_points()
            _registry = registry
        return _registry


def reset_registry() -> None:
    """Forget the registry so the next use rebuilds it (for tests and after changing the env)."""
    global _registry
    with _lock:
        _registry = None
