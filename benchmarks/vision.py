"""Images in, text out on lmdock-hf: a batch of requests with one image each against transformers
``generate`` one request at a time, and a second turn over the same image against the first.

1. ``--requests`` prompts, each with its own image, through ``LLM.generate`` (continuous batching:
   decode steps of all requests in one forward; each request's image encoded at its prefill) against
   transformers' ``generate`` on the processor's outputs, one request after another (what a plain
   transformers server does); the ratio is transformers' time over lmdock's.
2. Time to the first token of a second turn (the first turn's prompt, its answer and a follow-up,
   same image) right after the first turn, against the first turn from cold: the image is not
   encoded again and the first turn's KV state comes from the prefix cache.

Both run greedy, ``--new`` tokens, in one process, in interleaved rounds (order reversed every other
round); medians are printed.  Model: a random-weight LLaVA (CLIP tower over 224-pixel images: 256
image tokens; Llama with hidden 256, 4 layers), built from a fixed seed by
``lmdock_conformance.zoo_vision`` and cached on disk.  Speed targets live here, not in tests.
Run: ``HF_HUB_OFFLINE=1 LMDOCK_MODELS=../shared/models python benchmarks/vision.py [--requests 16] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 2048}
VISION = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}
PROMPT = "USER: <image> Once upon a time there was ASSISTANT:"


def _model() -> str:
    from pathlib import Path

    from lmdock_conformance.zoo_vision import build

    cache = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench"))
    path = cache / "llava-224-seed43"
    if not (path / "config.json").is_file():
        tmp = path.with_suffix(".tmp")
        build("llava", tmp, text=TEXT, vision=VISION, image_size=224)
        tmp.rename(path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch
    from _common import machine, table
    from lmdock import LLM
    from lmdock_conformance.zoo_vision import seeded_image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = _model()
    processor = AutoProcessor.from_pretrained(path)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, backend="hf", scheduler={"max_num_seqs": max(16, args.requests)})
    greedy = {"max_tokens": args.new, "temperature": 0, "ignore_eos": True}
    first = {**greedy, "max_tokens": 1}  # the turns: time to the first token

    def lmdock_batch(images: list[Any]) -> None:
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images], greedy)

    def hf_one_by_one(images: list[Any]) -> None:
        for im in images:
            inputs = processor(text=[PROMPT], images=[im], return_tensors="pt")
            with torch.no_grad():
                hf.generate(**inputs, max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)

    batch: dict[str, list[float]] = {"lmdock": [], "transformers": []}
    turns: dict[str, list[float]] = {"first turn": [], "second turn": []}
    for r in range(args.rounds):
        images = [seeded_image(1000 * r + i, (224, 224)) for i in range(args.requests)]
        runs = [("lmdock", lmdock_batch), ("transformers", hf_one_by_one)]
        for name, fn in runs if r % 2 == 0 else runs[::-1]:
            t0 = time.perf_counter()
            fn(images)
            batch[name].append(time.perf_counter() - t0)
        first_prompt = {"prompt": PROMPT, "multi_modal_data": {"image": images[0]}}
        answer = llm.generate(first_prompt, greedy)[0].outputs[0].text
        second = {"prompt": f"{PROMPT}{answer} USER: and then? ASSISTANT:", "multi_modal_data": {"image": images[0]}}
        for name, prompt in (("first turn", first_prompt), ("second turn", second)):
            llm.clear_cache()
            llm.engine.engine.vision.features.clear()  # cold: image encoded, whole prompt prefilled
            if name == "second turn":
                llm.generate(first_prompt, first)  # the first turn's image and KV state, as a chat leaves them
            t0 = time.perf_counter()
            llm.generate(prompt, first)
            turns[name].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in {**batch, **turns}.items()}
    print(machine())
    print(f"{args.requests} requests with one 224x224 image each, {args.new} new tokens, {args.rounds} rounds (medians)")
    print(table([("lmdock LLM.generate (batched)", f"{med['lmdock']:.2f} s", f"{med['transformers'] / med['lmdock']:.2f}x"),
                 ("transformers generate, one at a time", f"{med['transformers']:.2f} s", "1.00x")],
                ("run", "time", "speed vs transformers")))
    print(table([("first turn, cold (image encoded, whole prompt prefilled)", f"{med['first turn']:.3f} s"),
                 (f"second turn, after the first (same image: no encoding, prefix-cache hit), {med['first turn'] / med['second turn']:.2f}x",
                  f"{med['second turn']:.3f} s")],
                ("time to first token", "time")))
    print(f"vision tower runs: {llm.engine.engine.vision.encodes}")
    llm.shutdown()


if __name__ == "__main__":
    main()
