"""Images in, text out through ``lmdock serve`` (lmdock-hf): concurrent requests with one image each
against transformers ``generate`` one request at a time, and a second turn over the same image
against the first.

1. ``--requests`` chat requests (``POST /v1/chat/completions`` on 127.0.0.1, each with its own image as
   an ``image_url`` data URL), all sent at once to ``lmdock serve`` (continuous batching: the decode
   steps of all requests in one forward; the images of a step's prefills through the vision tower in
   one run), against transformers' ``generate`` on the processor's ``apply_chat_template`` of the same
   conversation, one request after another (what a plain transformers server does).  The ratio is
   transformers' time over the server's (HTTP, JSON, base64 and image decoding included on the
   server's side).  Every
   request's greedy text from the server is checked against transformers' decoded tokens (leading
   space aside: lmdock keeps the first token's SentencePiece space, as vLLM does).
2. Time to the first token (a ``max_tokens=1`` request) of a second turn (the first turn's
   conversation, its answer and a follow-up, same image) right after the first turn, against the
   first turn over a new image: the image is not encoded again and the first turn's KV state comes
   from the prefix cache.

Greedy, ``--new`` tokens, interleaved rounds (order reversed every other round); medians are printed.
The server and transformers each get ``--threads`` torch threads.  Model: a random-weight LLaVA (CLIP
tower over 224-pixel images: 256 image tokens; Llama with hidden 256, 4 layers), built from a fixed
seed by ``lmdock_conformance.zoo_vision`` and cached on disk.  Speed targets live here, not in tests.
Run: ``cd benchmarks && HF_HUB_OFFLINE=1 LMDOCK_MODELS=../shared/models python vision.py [--requests 16] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 2048}
VISION = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}
ASK = "Once upon a time there was "


def _model() -> str:
    from lmdock_conformance.zoo_vision import build

    cache = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench"))
    path = cache / "llava-224-seed43"
    if not (path / "config.json").is_file():
        tmp = path.with_suffix(".tmp")
        build("llava", tmp, text=TEXT, vision=VISION, image_size=224)
        tmp.rename(path)
    return str(path)


def _data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _openai_messages(image: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": ASK}, {"type": "image_url", "image_url": {"url": _data_url(image)}}]}]


def _hf_messages(image: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": ASK}, {"type": "image", "image": image}]}]


async def _chat(client: Any, messages: list[dict[str, Any]], tokens: int) -> str:
    body = {"model": "bench", "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"the server answered {r.status_code}: {r.text[:500]}")
    return str(r.json()["choices"][0]["message"]["content"])


class Transformers:
    """The reference: transformers' generate on the processor's outputs, one request at a time."""

    def __init__(self, path: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        torch.set_num_threads(threads)
        self.torch = torch
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def one(self, image: Any, tokens: int) -> str:
        inputs = self.processor.apply_chat_template(_hf_messages(image), add_generation_prompt=True, tokenize=True, return_dict=True,
                                                    return_tensors="pt")
        with self.torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return str(self.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


async def _rounds(args: argparse.Namespace, port: int, ref: Transformers) -> tuple[dict[str, list[float]], bool]:
    import httpx
    from lmdock_conformance.zoo_vision import seeded_image

    times: dict[str, list[float]] = {"server": [], "transformers": [], "first turn": [], "second turn": []}
    same = True
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        await _chat(client, _openai_messages(seeded_image(999_999, (224, 224))), 2)  # warm-up
        for r in range(args.rounds):
            images = [seeded_image(1000 * r + i, (224, 224)) for i in range(args.requests)]
            for name in ("server", "transformers") if r % 2 == 0 else ("transformers", "server"):
                t0 = time.perf_counter()
                if name == "server":
                    texts = await asyncio.gather(*(_chat(client, _openai_messages(im), args.new) for im in images))
                else:
                    want = [ref.one(im, args.new) for im in images]
                times[name].append(time.perf_counter() - t0)
            same = same and [t.lstrip() for t in texts] == [w.lstrip() for w in want]
            image = seeded_image(500_000 + r, (224, 224))  # a new image: the first turn encodes it
            first = _openai_messages(image)
            t0 = time.perf_counter()
            answer = await _chat(client, first, 1)
            times["first turn"].append(time.perf_counter() - t0)
            second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
            t0 = time.perf_counter()
            await _chat(client, second, 1)
            times["second turn"].append(time.perf_counter() - t0)
    return times, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from _common import machine, start_hf_server, stop, table, wait_up

    path = _model()
    ref = Transformers(path, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_hf_server(path, args.requests, args.threads, Path(tmp))
        try:
            asyncio.run(wait_up(proc, port, 300, "lmdock serve", Path(tmp) / "server.log"))
            times, same = asyncio.run(_rounds(args, port, ref))
        finally:
            stop(proc)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(machine())
    print(f"{args.requests} chat requests with one 224x224 image each (data URLs), {args.new} new tokens, {args.rounds} rounds "
          f"(medians), {args.threads} torch threads each; server's greedy text equals transformers': {same}")
    print(table([(f"lmdock serve, {args.requests} concurrent requests", f"{med['server']:.2f} s",
                  f"{med['transformers'] / med['server']:.2f}x"),
                 ("transformers generate, one at a time", f"{med['transformers']:.2f} s", "1.00x")],
                ("run", "time", "speed vs transformers")))
    print(table([("first turn, new image (image encoded, whole prompt prefilled)", f"{med['first turn']:.3f} s"),
                 (f"second turn, same image right after (no encoding, prefix-cache hit), {med['first turn'] / med['second turn']:.2f}x",
                  f"{med['second turn']:.3f} s")],
                ("time to first token (max_tokens=1 request)", "time")))


if __name__ == "__main__":
    main()
