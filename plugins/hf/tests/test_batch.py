"""`lmdock batch` on a real model: each line's text is what `LLM.generate` gives for the same request."""

from __future__ import annotations

import json
from pathlib import Path

from lmdock import LLM
from lmdock._cli import main
from stories_facts import stories_path


def test_batch_matches_generate_on_stories260k(tmp_path: Path) -> None:
    model = stories_path()
    prompts = ["Once upon a time", "The cat", "Lily and Ben"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "stories", "prompt": p, "max_tokens": 12, "temperature": 0}}) + "\n"
        for i, p in enumerate(prompts)))
    assert main(["batch", str(src), str(dst), "-m", model, "--backend", "hf"]) == 0
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in map(json.loads, dst.read_text().splitlines())}
    with LLM(model, backend="hf") as llm:
        want = [o.outputs[0].text for o in llm.generate(prompts, {"max_new_tokens": 12, "temperature": 0})]
    assert [got[f"r{i}"] for i in range(3)] == want
