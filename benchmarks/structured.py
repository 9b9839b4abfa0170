"""Structured output: decode speed with and without a JSON schema, and the per-step mask cost.

1. Decode tokens/s of the ~100M random Llama on lmdock-hf (float32, CPU) at batch 1 and 8, greedy,
   unconstrained and constrained to a JSON schema (an array of strings that does not close on its
   own), in the same run; the ratio is constrained / unconstrained (target: >= 0.9).
2. The mask cost of one decode step at vocabularies of 32k and 128k: llguidance's batched mask fill
   (``ConstraintFactory.fill_masks``) plus the vectorized masking of the logits
   (``lmdock._engine.constraints.apply_masks``), for batches of 1 and 8, walking a JSON document.
   The tokenizers are byte-level BPE trained here with the ``tokenizers`` library on generated text
   (random pseudo-words, Zipf-distributed) to exactly 32,000 and 128,000 tokens: vocabularies of
   real size and byte-level structure, not a real model's merges.

    python benchmarks/structured.py [--tokens 128] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine, random_llama, table  # noqa: E402

SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}}}, "required": ["words"]}
WALK_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 6},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    "score": {"type": "number"}, "active": {"type": "boolean"}}, "required": ["name", "age", "tags"]}
PROMPTS = ["Once upon a time", "The cat", "Lily and Tom", "One day", "The sun was", "A little dog", "Tim had a", "In the park"]


def decode(tokens: int) -> list[tuple[str, ...]]:
    from lmdock import LLM, SamplingParams

    rows = []
    with LLM(random_llama(), backend="hf", scheduler={"max_num_seqs": 8}) as llm:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=4, structured_output={"json": SCHEMA}))  # warm up, compile
        for batch in (1, 8):
            speed = {}
            for name, so in (("unconstrained", None), ("json schema", {"json": SCHEMA})):
                params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=so is None, structured_output=so)
                start = time.perf_counter()
                outs = llm.generate(PROMPTS[:batch], params)
                elapsed = time.perf_counter() - start
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                speed[name] = n / elapsed
            rows.append((f"batch {batch}", f"{speed['unconstrained']:.1f}", f"{speed['json schema']:.1f}", f"{speed['json schema'] / speed['unconstrained']:.2f}"))
    return rows


def bpe_tokenizer(vocab_size: int, folder: Path) -> Path:
    """A byte-level BPE tokenizer.json of exactly ``vocab_size`` tokens, trained on generated text (cached)."""
    path = folder / f"bpe-{vocab_size}.json"
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"))
    lexicon = ["".join(rng.choice(letters[:26] if i % 7 else letters, size=int(rng.integers(2, 12)))) for i in range(vocab_size * 2)]
    ranks = rng.zipf(1.15, size=3_000_000) % len(lexicon)
    punct = np.array([" ", " ", " ", " ", ", ", ". ", "\n", ": ", '"', "{", "}", "[", "]"])
    text = "".join(lexicon[r] + punct[r % len(punct)] for r in ranks)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    chunks = [text[i : i + 100_000] for i in range(0, len(text), 100_000)]
    tok.train_from_iterator(chunks, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


class _Tok:
    eos_token_id = 0

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(path))


def mask_cost(vocab_size: int, folder: Path, steps: int) -> list[tuple[str, ...]]:
    from lmdock import SamplingParams
    from lmdock._engine.constraints import apply_masks
    from lmdock._engine.structured import ConstraintFactory

    tok = _Tok(bpe_tokenizer(vocab_size, folder))
    vocab = tok.backend_tokenizer.get_vocab_size()
    t0 = time.perf_counter()
    factory = ConstraintFactory(tok, vocab, (0,))
    factory.ll_tokenizer()
    tok_s = time.perf_counter() - t0
    params = SamplingParams(structured_output={"json": WALK_SCHEMA})
    t0 = time.perf_counter()
    factory(params, 1)
    compile_ms = (time.perf_counter() - t0) * 1e3
    rows = []
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        cons = factory(params, batch)
        fill = apply = 0.0
        n = 0
        while n < steps:
            live = [c for c in cons if not c.is_complete()]
            if not live:
                cons = factory(params, batch)  # a new document
                continue
            logits = rng.standard_normal((len(live), vocab)).astype(np.float32)
            t0 = time.perf_counter()
            mask = np.zeros((len(live), vocab), dtype=bool)
            factory.fill_masks(live, mask)
            t1 = time.perf_counter()
            masked = apply_masks(logits, live, lambda _c, out, m=mask: np.copyto(out, m))
            t2 = time.perf_counter()
            fill += t1 - t0
            apply += t2 - t1
            for c, row in zip(live, masked):
                c.accept(int(np.argmax(row)))
            n += 1
        rows.append((f"{vocab:,}", str(batch), f"{fill / n * 1e3:.3f}", f"{apply / n * 1e3:.3f}", f"{(fill + apply) / n * 1e3:.3f}", f"{compile_ms:.1f}", f"{tok_s:.2f}"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request in the decode runs")
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed per mask-cost row")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "lmdock" / "bench")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    import llguidance

    print(f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else llguidance.get_version()}")
    if not args.skip_decode:
        print(f"\ndecode, random Llama ~100M, float32, greedy, {args.tokens} tokens per request")
        print(table(decode(args.tokens), ("requests", "unconstrained tok/s", "json schema tok/s", "constrained / unconstrained")))
    rows = []
    for v in (32_000, 128_000):
        rows += mask_cost(v, args.cache, args.steps)
    print(f"\nper-step mask cost (mean over {args.steps} steps walking a JSON document; ms)")
    print(table(rows, ("vocab", "batch", "fill (llguidance)", "apply (numpy)", "total", "compile ms", "tokenizer load s")))
    json.dumps(rows)


if __name__ == "__main__":
    main()
