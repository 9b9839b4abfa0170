"""``lmdock serve --speculative-config JSON`` (vLLM's flag) and speculative decoding's counters on
``/metrics``, under lmdock's names and vLLM's (``metric_names = "vllm"``), parsed with prometheus_client's
own text parser, from a real server on lmdock-hf (issue 42)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import Server

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("spec"), 'metric_names = "vllm"\n', args=("--speculative-config", json.dumps(SPEC)))
    yield s
    s.stop()


def _samples(server: Server) -> dict[str, list]:
    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text))
    return {s.name: s for f in families for s in f.samples if "spec_decode" in s.name} | {
        f"{s.name}{{{s.labels.get('position', '')}}}": s for f in families for s in f.samples if "per_pos" in s.name}


def test_the_flag_turns_speculation_on_and_metrics_count_it(server: Server) -> None:
    """The server runs with ``--speculative-config`` (the fixture): an edit-like completion is right,
    and the counters under both names agree with ``/stats``."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    text = client.completions.create(model="stories", prompt=f"{STORY} {STORY} Once upon a time", max_tokens=40, temperature=0).choices[0].text
    assert text.startswith(", there was a little girl named Lily")
    m = _samples(server)
    for prefix in ("lmdock:", "vllm:"):
        drafts = m[f"{prefix}spec_decode_num_draft_tokens_total"].value
        accepted = m[f"{prefix}spec_decode_num_accepted_tokens_total"].value
        assert 0 < accepted <= drafts
        assert m[f"{prefix}spec_decode_num_drafts_total"].value > 0
        assert m[f"{prefix}spec_decode_num_accepted_tokens_per_pos_total{{0}}"].value > 0
    stats = server.stats()
    assert stats["spec_decode_num_accepted_tokens"] == m["lmdock:spec_decode_num_accepted_tokens_total"].value


def test_a_bad_flag_is_refused_saying_what_to_give(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("lmdock")
    out = subprocess.run([str(exe), "serve", "m", "--speculative-config", "{method: ngram}"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--speculative-config: not JSON" in out.stderr and "num_speculative_tokens" in out.stderr
