"""Check that each constraints file here pins the lowest versions its plugin declares.

scripts/test.sh runs this before it builds the *-lowest environments: a lower bound raised or lowered
in a plugin's pyproject.toml without its constraints file here would otherwise go on testing versions
the plugin no longer declares (a raise fails the install loudly; a lowered bound would not).

Each ``name==version`` line must name an engine requirement of the plugin (its dependencies or
extras) whose ``>=`` lower bound is that version's release prefix (``>=1.24`` and ``==1.24.1``: 1.24.0
was never released), and the version must be inside every bound the requirement declares.
With a plugin's name, run by that lowest environment's Python, it checks instead that what is
installed there is what the file pins (a pin of a package that nothing installed would pass pip's -c
silently) and prints the versions.
Usage: python scripts/lowest/check.py [hf|onnx|mlx]   (Python 3.11+, standard library only)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = {"hf": ROOT / "plugins/hf", "onnx": ROOT / "plugins/onnx", "mlx": ROOT / "plugins/mlx"}
_REQ = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.strip().split("."))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(pyproject: Path) -> dict[str, list[str]]:
    """name -> the specifier strings of every requirement on it (dependencies and extras)."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    lines = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    out: dict[str, list[str]] = {}
    for line in lines:
        m = _REQ.match(line)
        if m:
            out.setdefault(_norm(m.group(1)), []).append(m.group(2).strip())
    return out


def _satisfies(version: tuple[int, ...], spec: str) -> bool:
    ops = {
        ">=": lambda a, b: a >= b,
        "<": lambda a, b: a < b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        "==": lambda a, b: a == b,
    }
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, bound = re.match(r"(>=|<=|==|<|>)\s*(.+)", clause).groups()  # type: ignore[union-attr]
        b = _v(bound)
        width = max(len(version), len(b))
        if not ops[op](version + (0,) * (width - len(version)), b + (0,) * (width - len(b))):
            return False
    return True


def _pins(plugin: str) -> list[tuple[str, str]]:
    text = Path(__file__).with_name(f"{plugin}.txt").read_text(encoding="utf-8")
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [(name.strip(), pin.strip()) for name, _, pin in (line.partition("==") for line in lines if line)]


def installed(plugin: str) -> int:
    from importlib.metadata import PackageNotFoundError, version

    problems, found = [], []
    for name, pin in _pins(plugin):
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "not installed"
        found.append(f"{name} {have}")
        if have != pin:
            problems.append(f"{plugin}-lowest: {name} is {have}, scripts/lowest/{plugin}.txt pins {pin}")
    print(f"{plugin}-lowest engine packages: " + ", ".join(found))
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    if len(sys.argv) > 1:
        return installed(sys.argv[1])
    problems = []
    for plugin, folder in PLUGINS.items():
        constraints = Path(__file__).with_name(f"{plugin}.txt")
        declared = _requirements(folder / "pyproject.toml")
        for line in constraints.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, pin = line.partition("==")
            specs = declared.get(_norm(name))
            if not pin or not specs:
                problems.append(f"{constraints.name}: {line!r} is not a name==version pin of a {plugin} requirement")
                continue
            version = _v(pin)
            for spec in specs:
                floor = re.search(r">=\s*([0-9.]+)", spec)
                if (
                    floor is None
                    or version[: len(_v(floor.group(1)))] != _v(floor.group(1))
                    or not _satisfies(version, spec)
                ):
                    problems.append(
                        f"{constraints.name}: {name}=={pin} is not the lowest release of {name}{spec} ({folder.name}/pyproject.toml)"
                    )
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
