"""lmdock-hf: what its BackendSpec declares works as `pip install lmdock-hf` installs it."""

from __future__ import annotations

# Every capability and quantization algorithm the BackendSpec declares, exercised in the environment a
# user's `pip install` gives (scripts/test.sh installs nothing else that the backend could lean on): a
# declared feature that needs a package the distribution does not depend on fails here, by name.
import math
import os
import typing
from pathlib import Path
from typing import Any

import lmdock
import pytest
from lmdock import LLM, QuantConfig, SamplingParams
from lmdock._plugins import get_registry

MODEL = str(Path(os.environ["LMDOCK_MODELS"]) / "stories260K")
PROMPT = "Once upon a time"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
BACKEND = "hf"
LOAD_OPTIONS: dict[str, Any] = {}
ALGOS = [a for a in typing.get_args(typing.get_type_hints(QuantConfig)["algo"]) if a != "none"]


def _spec() -> Any:
    return get_registry().backend(BACKEND)


def _check_generate(llm: LLM) -> None:
    out = llm.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})[0].outputs[0]
    assert out.token_ids and out.text


def _check_chat(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": PROMPT}], {"temperature": 0, "max_new_tokens": 4}, chat_template=TEMPLATE)
    assert out[0].outputs[0].token_ids


def _check_stream(llm: LLM) -> None:
    params = {"temperature": 0, "max_new_tokens": 4}
    snapshots = list(llm.stream(PROMPT, params))
    assert snapshots[-1].finished
    assert snapshots[-1].outputs[0].text == llm.generate_async(PROMPT, params).result(timeout=120).outputs[0].text


def _check_sampling(llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                            frequency_penalty=0.1, presence_penalty=0.1, seed=7, max_new_tokens=6, n=2)
    a, b = llm.generate([PROMPT, PROMPT], params)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded: reproducible
    assert len(a.outputs) == 2


def _check_logprobs(llm: LLM) -> None:
    out = llm.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3, "logprobs": 2})[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)


def _check_prompt_logprobs(llm: LLM) -> None:
    out = llm.generate(PROMPT, {"temperature": 0, "max_new_tokens": 1, "prompt_logprobs": 0})[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def _check_next_token_logprobs(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    row = llm.next_token_logprobs_sync(ids).tolist()
    assert len(row) > 1
    assert abs(math.fsum(math.exp(v) for v in row) - 1.0) < 1e-3


def _check_beam_search(llm: LLM) -> None:
    out = llm.generate(PROMPT, {"beam_width": 2, "n": 2, "temperature": 0, "max_new_tokens": 3})[0]
    assert len(out.outputs) == 2


def _check_structured_output(llm: LLM) -> None:
    out = llm.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8, "structured_output": {"choice": ["yes", "no"]}})[0]
    assert out.outputs[0].text in ("yes", "no")


def _embedding_llm() -> LLM:
    path = os.environ.get("LMDOCK_EMBED_MODEL")
    assert path, "set LMDOCK_EMBED_MODEL to an embedding model folder (scripts/test.sh takes all-MiniLM-L6-v2's)"
    return LLM(path, backend=BACKEND)


def _check_embed(llm: LLM) -> None:
    with _embedding_llm() as e:
        out = e.embed(["a cat sits", "a kitten is sitting"])
    assert len(out) == 2 and len(out[0].outputs.embedding) > 1


def _check_score(llm: LLM) -> None:
    with _embedding_llm() as e:
        scores = [o.outputs.score for o in e.score("a cat sits", ["a kitten is sitting", "stock market crash"])]
    assert scores[0] > scores[1]


def _check_offload(llm: LLM) -> None:
    with LLM(MODEL, backend=BACKEND, offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0}) as o:
        assert o.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})[0].outputs[0].token_ids


CHECKS = {
    "generate": _check_generate,
    "chat": _check_chat,
    "stream": _check_stream,
    "sampling": _check_sampling,
    "logprobs": _check_logprobs,
    "prompt_logprobs": _check_prompt_logprobs,
    "next_token_logprobs": _check_next_token_logprobs,
    "beam_search": _check_beam_search,
    "structured_output": _check_structured_output,
    "quantization": lambda llm: None,  # each declared algorithm is loaded below
    "embed": _check_embed,
    "score": _check_score,
    "offload": _check_offload,
}


@pytest.fixture(scope="module")
def llm() -> Any:
    with LLM(MODEL, backend=BACKEND, **LOAD_OPTIONS) as model:
        yield model


def test_every_declared_capability_works(llm: LLM) -> None:
    declared = sorted(_spec().supports)
    unchecked = [c for c in declared if c not in CHECKS]
    assert not unchecked, f"{BACKEND} declares {unchecked} and this file has no check for it: add one"
    for capability in declared:
        CHECKS[capability](llm)


def test_declared_quantization_algorithms_load_and_generate() -> None:
    spec = _spec()
    algos = [a for a in ALGOS if a in spec.tolerances]  # tolerances name each algorithm it honours
    assert bool(algos) == ("quantization" in spec.supports), f"{BACKEND}: 'quantization' declared without tolerances, or the reverse"
    for algo in algos:
        with LLM(MODEL, backend=BACKEND, quantization={"algo": algo}, **LOAD_OPTIONS) as q:
            out = q.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})[0].outputs[0]
        assert out.token_ids, algo
    assert lmdock.__version__
