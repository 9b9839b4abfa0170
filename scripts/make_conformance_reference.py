"""Record the transformers float32 reference that lmdock-conformance compares backends against.

Run once in an environment with torch and transformers (the hf test environment):
    HF_HUB_OFFLINE=1 python scripts/make_conformance_reference.py ../shared/models/stories260K
It writes conformance_tests/src/lmdock_conformance/data/stories260K.json.  The greedy tokens it
records must equal the ones published in ../shared/models/README.md (checked here), so the file
agrees with a reference made outside this project.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "Once upon a time"
#: A prompt where beam search (4 beams) and greedy differ from the first token on, so a backend that
#: ignores beam_width cannot pass the beam test.
BEAM_PROMPT = "The cat"
PUBLISHED = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
             419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]
TOP = 8


def main(folder: str) -> None:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tok.encode(PROMPT)
    t = torch.tensor([ids])
    with torch.no_grad():
        greedy = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
        assert greedy == PUBLISHED, "transformers disagrees with the published greedy reference"
        seq = ids + greedy
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), dim=-1)
        beams = model.generate(t, attention_mask=torch.ones_like(t), num_beams=4, max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
        beam_ids = tok.encode(BEAM_PROMPT)
        bt = torch.tensor([beam_ids])
        beam_greedy = model.generate(bt, attention_mask=torch.ones_like(bt), max_new_tokens=30, do_sample=False)[0, len(beam_ids):].tolist()
        beam_differs = model.generate(bt, attention_mask=torch.ones_like(bt), num_beams=4, max_new_tokens=30, do_sample=False)[0, len(beam_ids):].tolist()
        assert beam_differs[0] != beam_greedy[0], "pick a BEAM_PROMPT where beam search and greedy differ"
        raw_logits = model(t).logits[0, -1].double().tolist()  # for penalties, which are not shift-invariant
        prefixes = [ids, ids[:3], seq[:12]]
        next_lp = [torch.log_softmax(model(torch.tensor([p])).logits[0, -1].double(), dim=-1).tolist() for p in prefixes]
    positions = []
    for i in range(len(seq) - 1):
        top = torch.topk(lp[i], TOP)
        positions.append({"next": seq[i + 1], "logprob": lp[i, seq[i + 1]].item(),
                          "top": [[int(a), float(b)] for a, b in zip(top.indices.tolist(), top.values.tolist())]})
    data = {
        "model": "stories260K",
        "made_with": f"transformers float32, eager attention; torch {torch.__version__}",
        "prompt": PROMPT,
        "prompt_ids": ids,
        "greedy_40": greedy,
        "greedy_40_text": tok.decode(greedy, skip_special_tokens=True),
        "positions": positions,
        "beam4_30": beams,
        "beam_prompt_ids": beam_ids,
        "beam_prompt_greedy_30": beam_greedy,
        "beam_prompt_beam4_30": beam_differs,
        "next_token_logits": raw_logits,
        "next_token": [{"prefix": p, "logprobs": v} for p, v in zip(prefixes, next_lp)],
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "vocab_size": model.config.vocab_size,
        "context": model.config.max_position_embeddings,
    }
    out = Path(__file__).resolve().parents[1] / "conformance_tests/src/lmdock_conformance/data/stories260K.json"
    out.write_text(json.dumps(data))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
