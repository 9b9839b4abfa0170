"""What a backend's BackendSpec declares works in the environment ``pip install`` gives.

Each plugin's ``tests/test_declared.py`` calls these two checks for its backend, in an environment
that holds only what a user's ``pip install`` gives (plus test tools): a declared capability or
quantization algorithm that needs a package the distribution does not depend on fails here, by name.
The embed and score checks load the embedding model named by ``$LMDOCK_EMBED_MODEL``.
"""

from __future__ import annotations

import json
import math
import os
import typing
from typing import Any

from lmdock import LLM, QuantConfig, SamplingParams

PROMPT = "Once upon a time"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
ALGOS = [a for a in typing.get_args(typing.get_type_hints(QuantConfig)["algo"]) if a != "none"]


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


def _check_logit_bias(llm: LLM) -> None:
    plain = llm.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})[0].outputs[0].token_ids
    out = llm.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4, "logit_bias": {plain[0]: -100}, "bad_words": ["the"],
                                "allowed_token_ids": list(range(3, 200))})[0].outputs[0].token_ids
    assert out and plain[0] not in out and all(3 <= t < 200 for t in out)


def _check_tools(llm: LLM) -> None:
    from lmdock_conformance.test_tools import TEMPLATE, TOOLS, WEATHER

    out = llm.chat([{"role": "user", "content": PROMPT}], {"temperature": 0, "max_new_tokens": 200}, chat_template=TEMPLATE,
                   tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})[0].outputs[0]
    (call,) = out.tool_calls
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == set(WEATHER["required"])


def _embedding_llm(backend: str) -> LLM:
    path = os.environ.get("LMDOCK_EMBED_MODEL")
    assert path, "set LMDOCK_EMBED_MODEL to an embedding model folder (scripts/test.sh takes all-MiniLM-L6-v2's)"
    return LLM(path, backend=backend)


def _check_embed(llm: LLM) -> None:
    with _embedding_llm(llm.backend.name) as e:
        out = e.embed(["a cat sits", "a kitten is sitting"])
    assert len(out) == 2 and len(out[0].outputs.embedding) > 1


def _check_score(llm: LLM) -> None:
    with _embedding_llm(llm.backend.name) as e:
        scores = [o.outputs.score for o in e.score("a cat sits", ["a kitten is sitting", "stock market crash"])]
    assert scores[0] > scores[1]


def _check_offload(llm: LLM) -> None:
    with LLM(llm.model_config.model, backend=llm.backend.name, offload={"weights_gpu_percent": 0, "weights_cpu_percent": 0}) as o:
        assert o.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})[0].outputs[0].token_ids


def _check_lora(llm: LLM) -> None:
    import tempfile

    from lmdock import LoRARequest

    from lmdock_conformance._models import lora_adapter

    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as folder:
        lora = LoRARequest("declared", lora_adapter(llm.model_config.model, folder, seed=1))
        base = llm.generate(PROMPT, params)[0].outputs[0].token_ids
        mixed = llm.generate([PROMPT, PROMPT], params, lora_request=[None, lora])
    assert mixed[0].outputs[0].token_ids == base
    assert mixed[1].outputs[0].token_ids != base


CHECKS = {
    "generate": _check_generate,
    "chat": _check_chat,
    "stream": _check_stream,
    "sampling": _check_sampling,
    "logit_bias": _check_logit_bias,
    "logprobs": _check_logprobs,
    "prompt_logprobs": _check_prompt_logprobs,
    "next_token_logprobs": _check_next_token_logprobs,
    "beam_search": _check_beam_search,
    "structured_output": _check_structured_output,
    "tools": _check_tools,
    "quantization": lambda llm: None,  # each declared algorithm is loaded below
    "embed": _check_embed,
    "score": _check_score,
    "offload": _check_offload,
    "lora": _check_lora,
    # model features: stories260K needs none; test_families checks each one per family on the zoo
    # (--lmdock-zoo), where a declared feature must give transformers' tokens
    **dict.fromkeys(("sliding_window", "attention_sinks", "logit_softcapping", "recurrent_state", "moe"), lambda llm: None),
    # images need a vision-language model: test_vision builds its own and holds each to transformers
    "vision": lambda llm: None,
}


def every_declared_capability_works(backend: str, model: str, **load_options: Any) -> None:
    """Exercise each capability the backend's spec supports (a declared one with no check fails)."""
    from lmdock._plugin.manager import get_registry

    declared = sorted(get_registry().backend(backend).supports)
    unchecked = [c for c in declared if c not in CHECKS]
    assert not unchecked, f"{backend} declares {unchecked} and lmdock_conformance.declared has no check for it: add one"
    with LLM(model, backend=backend, **load_options) as llm:
        for capability in declared:
            CHECKS[capability](llm)


def declared_quantization_algorithms_load_and_generate(backend: str, model: str, **load_options: Any) -> None:
    """Each QuantConfig algorithm the spec honours (it names a tolerance for it) loads and generates."""
    from lmdock._plugin.manager import get_registry

    spec = get_registry().backend(backend)
    algos = [a for a in ALGOS if a in spec.tolerances]
    assert bool(algos) == ("quantization" in spec.supports), f"{backend}: 'quantization' declared without tolerances, or the reverse"
    for algo in algos:
        with LLM(model, backend=backend, quantization={"algo": algo}, **load_options) as q:
            out = q.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})[0].outputs[0]
        assert out.token_ids, algo
