"""docs/model-families.md is what the family conformance runs found (docs/families/*.json, rendered by
scripts/gen_model_families.py), and each run's outcomes agree with the backend's declaration: a family
refused in the run is one the spec refuses, an exact one is one it runs, and nothing diverges."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: where each backend's entry module lives (it imports lmdock alone, so the core's env loads it)
ENTRY = {"hf": "plugins/hf/src/lmdock_hf", "onnx": "plugins/onnx/src/lmdock_onnx", "mlx": "plugins/mlx/src/lmdock_mlx",
         "vllm": "plugins/vllm/src/lmdock_vllm", "trtllm": "plugins/trtllm/src/lmdock_trtllm",
         "llamacpp": "contrib/llamacpp/src/lmdock_llamacpp", "template": "contrib/backend-template/src/lmdock_template"}


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _generator() -> Any:
    return _load("gen_model_families", ROOT / "scripts" / "gen_model_families.py")


def _spec(backend: str) -> Any:
    return _load(f"_docs_spec_{backend}", ROOT / ENTRY[backend] / "__init__.py").SPEC


def test_the_model_families_page_is_current() -> None:
    gen = _generator()
    runs = gen.load()
    assert runs, "docs/families holds no run"
    assert (ROOT / "docs" / "model-families.md").read_text() == gen.render(runs), \
        "docs/model-families.md is stale: run python scripts/gen_model_families.py"


@pytest.mark.parametrize("backend", sorted(p.stem for p in (ROOT / "docs" / "families").glob("*.json")))
def test_each_outcome_agrees_with_the_declaration(backend: str) -> None:
    from lmdock._plugin.declare import family_refusal
    from lmdock._plugin.families import ModelFeatures

    spec = _spec(backend)
    run = _generator().load()[backend]
    assert run["backend"] == spec.name
    for family, outcome in run["families"].items():
        assert outcome["outcome"] in ("exact", "refused"), f"{backend} {family}: {outcome['outcome']} ({outcome['reason']})"
        found = ModelFeatures(outcome["model_type"], dict.fromkeys(outcome["features"], "it"))
        refusal = family_refusal(spec, found, "the model")
        if outcome["outcome"] == "refused":
            assert refusal, f"{backend} refused {family} in the run, but its declaration runs it: re-run the family tests"
        else:
            assert refusal is None, f"{backend} ran {family} exactly, but its declaration refuses it: {refusal}"


def test_a_ci_run_must_reproduce_each_outcome_and_each_exactness_within_the_window(tmp_path: Path) -> None:
    """scripts/test.sh compares every family run with the committed outcomes (gen_model_families.py --compare): a
    changed outcome, or a refused family no longer exact with the context capped at its window, fails CI; a
    refusal's wording may change."""
    import json

    gen = _generator()
    committed = json.loads((ROOT / "docs" / "families" / "mlx.json").read_text())
    capped = next(f for f, o in committed["families"].items() if o.get("within_window") == "exact")
    run = tmp_path / "run.json"

    def diffs(change: dict[str, Any]) -> list[str]:
        outcome = {k: v for k, v in {**committed["families"][capped], **change}.items() if v is not None}
        families = {**committed["families"], capped: outcome}
        run.write_text(json.dumps({**committed, "families": families}))
        return gen.compare(run)

    assert diffs({"reason": "reworded"}) == []
    assert [d.split(":")[0] for d in diffs({"within_window": None})] == [capped]
    assert "committed refused (exact ≤ window), this run exact" in diffs({"outcome": "exact", "within_window": None})[0]
