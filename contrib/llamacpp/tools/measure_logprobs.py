"""Largest logprob error of lmdock-llamacpp against lmdock-conformance's transformers float32 reference,
with flash attention auto/off/on.  Run from the repository root:
``python contrib/llamacpp/tools/measure_logprobs.py $LMDOCK_MODELS/stories260K-gguf/stories260K.gguf``."""
import json
import sys

import numpy as np
from lmdock import LLM, SamplingParams

ref = json.load(open("conformance_tests/src/lmdock_conformance/data/stories260K.json"))
gguf = sys.argv[1]
for fa in ("auto", "off", "on"):
    with LLM(gguf, backend="llamacpp", backends={"llamacpp": {"flash_attn": fa}}) as llm:
        got = llm.batch_next_token_logprobs_sync([i["prefix"] for i in ref["next_token"]])
        full = max(float(np.abs(np.array(g) - np.array(i["logprobs"])).max()) for g, i in zip(got, ref["next_token"]))
        top = max(float(np.abs(np.array(g)[[t for t, _ in i["top"]]] - np.array([v for _, v in i["top"]])).max()) if "top" in i else 0 for g, i in zip(got, ref["next_token"]))
        ids = ref["prompt_ids"]
        out = llm.generate(ref["prompt"], SamplingParams(temperature=0, max_new_tokens=20, logprobs=5))[0].outputs[0]
        n = len(ids)
        gen = 0.0
        for j, pos in enumerate(out.logprobs):
            r = ref["positions"][n - 1 + j]
            rt = dict(r["top"])
            gen = max(gen, abs(pos[out.token_ids[j]].logprob - r["logprob"]), *(abs(lp.logprob - rt[t]) for t, lp in pos.items() if t in rt))
        print(f"flash_attn={fa}: full next-token vectors max |err| {full:.2e}; generated tokens' top-5 max |err| {gen:.2e}")
