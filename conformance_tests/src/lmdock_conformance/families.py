"""What test_families needs beside its tests: the zoo's families for this run, the comparison with
the reference (a divergence at a near-tie is not a failure), and each family's outcome for
``--lmdock-zoo-outcomes`` (the data docs/model-families.md is rendered from)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest


def zoo_families(config: pytest.Config) -> list[str]:
    """The families test_families runs: every one in ``--lmdock-zoo``'s zoo.json, or the ones named
    by ``--lmdock-zoo-families``; [] without a zoo (the tests then skip, saying how to build one)."""
    folder = config.getoption("--lmdock-zoo", default=None)
    if not folder or not config.getoption("--lmdock-backend"):
        return []
    from lmdock_conformance.zoo import read

    built = read(folder)["families"]
    wanted = config.getoption("--lmdock-zoo-families", default=None)
    if not wanted:
        return list(built)
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in built]
    if unknown:
        raise pytest.UsageError(f"--lmdock-zoo-families: {unknown} are not in {folder} (built: {', '.join(built)})")
    return names


def first_divergence(got: list[int], ref: dict[str, Any], tie: float) -> str | None:
    """None when ``got`` equals the reference tokens, or first differs where the reference's top-2
    margin is below ``tie`` (float noise may pick either); else what differs, where."""
    want = ref["tokens"]
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            margin = ref["margins"][i]
            if margin < tie:
                return None
            return f"token {i}: got {a}, transformers {b} (top-2 margin {margin:.4f}); got {got}, want {want}"
    if len(got) != len(want):
        return f"{len(got)} tokens, transformers {len(want)}: got {got}, want {want}"
    return None


class Outcomes:
    """Each family's outcome in this run: refused at load (with the reason), diverged (a test
    failed), or exact (its tests passed)."""

    def __init__(self) -> None:
        self.refused: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.passed: set[str] = set()
        self.features: dict[str, dict[str, Any]] = {}
        #: families with no checkpoint in the backend's format (a GGUF the converter would not write), with the reason
        self.not_converted: dict[str, str] = {}
        #: windowed families the backend refuses at full length and runs exactly with the context capped at the window
        self.within_window: set[str] = set()

    def note(self, report: pytest.TestReport) -> None:
        match = re.search(r"test_families\.py::(\w+)\[([\w-]+)\]$", report.nodeid)
        if not match or match.group(2) == "no-zoo":
            return
        family = match.group(2)
        if report.failed:
            errors = [line[1:].strip() for line in str(report.longrepr).splitlines() if line.startswith("E ")]
            self.failed.setdefault(family, f"{match.group(1)}: {(errors or ['failed'])[0][:300]}")
        elif report.passed and report.when == "call":
            self.passed.add(family)
            if match.group(1) == "test_a_context_within_the_window_runs_without_one":
                self.within_window.add(family)

    def outcome(self, family: str) -> dict[str, str]:
        if family in self.refused:
            capped = {"within_window": "exact"} if family in self.within_window else {}
            return {"outcome": "refused", "reason": self.refused[family], **capped}
        if family in self.failed:
            return {"outcome": "diverged", "reason": self.failed[family]}
        return {"outcome": "exact", "reason": ""}

    def write(self, target: str | Path, spec: Any) -> None:
        seen = sorted(self.refused.keys() | self.failed.keys() | self.passed)
        data = {"backend": spec.name, "package": spec.package, "engine": spec.engine_info(),
                "families": {f: {**self.outcome(f), **self.features.get(f, {})} for f in seen}}
        if self.not_converted:
            data["not_converted"] = dict(sorted(self.not_converted.items()))
        Path(target).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


OUTCOMES = Outcomes()
