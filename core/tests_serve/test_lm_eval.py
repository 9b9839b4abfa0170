"""lm-evaluation-harness (``local-completions``, ``tokenizer_backend=remote``) against ``lmdock serve``.

Two small offline tasks made from local JSON files: a loglikelihood multiple-choice task and a
``generate_until`` task.  Each loglikelihood lm-eval reads from the server must equal the one lmdock
computes in-process from ``prompt_logprobs`` on the same token ids, within 1e-4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from serve_helpers import Server, models_dir

MC = [
    {"context": "Once upon a time, there was a little", "choices": ["girl", "dog", "car"], "label": 0},
    {"context": "She loved to play outside in the", "choices": ["park", "sky", "ball"], "label": 0},
    {"context": "One day, she saw a big, red", "choices": ["ball", "tree", "house"], "label": 0},
]
GEN = [
    {"context": "Once upon a time", "answer": ", there was a little girl named Lily."},
    {"context": "Lily loved to play", "answer": "?"},
]


def _tasks(tmp: Path) -> Path:
    (tmp / "mc.json").write_text("\n".join(json.dumps(d) for d in MC), encoding="utf-8")
    (tmp / "gen.json").write_text("\n".join(json.dumps(d) for d in GEN), encoding="utf-8")
    (tmp / "lmdock_mc.yaml").write_text(f"""task: lmdock_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / 'mc.json'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""", encoding="utf-8")
    (tmp / "lmdock_gen.yaml").write_text(f"""task: lmdock_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / 'gen.json'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
""", encoding="utf-8")
    return tmp


def test_lm_eval_loglikelihoods_equal_in_process_prompt_logprobs(server: Server, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lmdock import LLM, SamplingParams

    tasks = _tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=stories,base_url={server.url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1",
        tasks=["lmdock_mc", "lmdock_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    assert results is not None
    mc = results["samples"]["lmdock_mc"]
    gen = results["samples"]["lmdock_gen"]
    assert len(mc) == len(MC) and len(gen) == len(GEN)
    # the greedy continuation is the documented one, cut at the first "."
    first = next(s for s in gen if s["doc"]["context"] == "Once upon a time")
    assert first["filtered_resps"][0] == ", there was a little girl named Lily"

    with LLM(str(models_dir()), backend="hf", build={"dtype": "float32"}) as llm:
        tok = llm.tokenizer
        checked = 0
        for sample in mc:
            for (context, continuation), (ll, _greedy) in zip((r["arguments"] for r in sample["arguments"].values())
                                                             if isinstance(sample["arguments"], dict) else sample["arguments"],
                                                             (r[0] for r in sample["resps"])):
                n_spaces = len(context) - len(context.rstrip())
                if n_spaces:
                    context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
                whole = tok.encode(context + continuation, add_special_tokens=False)
                ctxlen = len(tok.encode(context, add_special_tokens=False))
                out = llm.generate([whole], SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0))[0]
                expected = sum(out.prompt_logprobs[i][whole[i]].logprob for i in range(ctxlen, len(whole)))
                assert ll == pytest.approx(expected, abs=1e-4), (context, continuation)
                checked += 1
    assert checked == sum(len(d["choices"]) for d in MC)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_lm_eval_with_an_api_key_as_documented(strict: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/server.md: with a key on the server, lm-eval gets it as OPENAI_API_KEY (completions) and
    auth_token in model_args (its remote tokenizer)."""
    import httpx

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "sekret-key")
    import lm_eval
    from lm_eval.tasks import TaskManager

    assert httpx.get(f"{strict.url}/tokenizer_info").status_code == 401  # every route but /health needs the key
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=stories,base_url={strict.url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
                   "max_retries=1,auth_token=sekret-key",
        tasks=["lmdock_gen"],
        task_manager=TaskManager(include_path=str(_tasks(tmp_path))),
        log_samples=True,
    )
    assert results is not None
    first = next(s for s in results["samples"]["lmdock_gen"] if s["doc"]["context"] == "Once upon a time")
    assert first["filtered_resps"][0] == ", there was a little girl named Lily"
