"""``lmdock serve`` against the in-process ``LLM`` API: the same streaming workload, same backend and model.

64 concurrent streaming requests (token-id prompts of 16-128 tokens, 64 greedy output tokens each, EOS
ignored) on a random-weight Llama of about 100M parameters (benchmarks/_common.py) on the hf backend.
In-process: 64 streamed requests on one event loop (the engine's snapshots, as ``stream_generate`` uses).  Server: ``lmdock serve`` in a
subprocess on 127.0.0.1 and 64 streaming ``/v1/completions`` requests from the ``openai`` client's
async API.  Printed as ``vllm bench serve`` does: throughput, TTFT and inter-token latency p50/p99
(both sides measure the arrival of streamed chunks), and the server/in-process throughput ratio
(target: >= 0.95).  Needs ``lmdock[serve]``, ``lmdock-hf`` and ``openai``.

``--client raw`` (or ``both``) reads the server's SSE with a bare asyncio connection instead, as
``vllm bench serve`` reads it with aiohttp, so that the client's own per-chunk work (the openai
package parses every chunk into pydantic objects) is not charged to the server.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/server.py [--requests 64] [--tokens 64] [--threads N] [--client openai|raw|both]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(16, 128) - 1)] for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


class Trace:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.arrivals: list[float] = []

    def ttft(self) -> float:
        return self.arrivals[0] - self.start

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def summarize(name: str, traces: list[Trace], tokens: int, wall: float) -> dict[str, Any]:
    ttfts = [t.ttft() * 1000 for t in traces]
    itls = [x * 1000 for t in traces for x in t.itls()]
    return {"run": name, "req/s": len(traces) / wall, "tok/s": tokens / wall, "ttft50": pct(ttfts, 50), "ttft99": pct(ttfts, 99),
            "itl50": pct(itls, 50), "itl99": pct(itls, 99), "wall": wall}


async def in_process(path: str, prompts: list[list[int]], n: int, threads: int) -> dict[str, Any]:
    from lmdock import LLM, SamplingParams
    from lmdock._sinks import AsyncQueueSink

    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    with LLM(path, backend="hf", scheduler={"max_num_seqs": len(prompts)}, backends={"hf": {"num_threads": threads}}) as llm:
        llm.generate([prompts[0]], params, use_tqdm=False)  # warm-up

        async def one(ids: list[int]) -> Trace:
            # stream_generate yields text deltas only, and a random model's token may decode to no
            # text; count outputs by tokens, as the server sends a chunk per step with new tokens.
            tr = Trace()
            request = llm._request(ids, params, stream=True)
            sink = AsyncQueueSink(asyncio.get_running_loop())
            llm.engine.submit(request, sink)
            seen = 0
            while True:
                out = await sink.queue.get()
                if isinstance(out, BaseException):
                    raise out
                if len(out.outputs[0].token_ids) > seen:
                    seen = len(out.outputs[0].token_ids)
                    tr.arrivals.append(time.perf_counter())
                if out.finished:
                    return tr

        t0 = time.perf_counter()
        traces = await asyncio.gather(*(one(p) for p in prompts))
        return summarize("in-process LLM (streamed)", list(traces), n * len(prompts), time.perf_counter() - t0)


async def raw_stream(port: int, body: dict[str, Any], tr: Trace) -> None:
    """One streaming POST /v1/completions over a bare asyncio connection, as ``vllm bench serve``
    reads SSE with aiohttp: an arrival per ``data:`` event with a non-empty ``choices`` list (uvicorn
    sends each event in one chunk, so an event is one line here), no JSON parsing of the chunks."""
    import json

    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise SystemExit(f"lmdock serve answered {status!r}")
    try:
        while line := await reader.readline():
            if line.startswith(b"data: {") and b'"choices":[{' in line:
                tr.arrivals.append(time.perf_counter())
    finally:
        writer.close()


async def through_server(path: str, prompts: list[list[int]], n: int, threads: int, client_kind: str = "openai") -> dict[str, Any]:
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="lmdock-bench-"))
    cfg = tmp / "lmdock.toml"
    cfg.write_text(f'default_model = "bench"\n[server]\nport = {port}\n[models.bench]\nmodel = "{path}"\nbackend = "hf"\n'
                   f'scheduler = {{ max_num_seqs = {len(prompts)} }}\n[models.bench.backends.hf]\nnum_threads = {threads}\n')
    exe = Path(sys.executable).with_name("lmdock")
    proc = subprocess.Popen([str(exe), "serve", "--config", str(cfg), "--log-level", "warning"], stderr=subprocess.DEVNULL)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        deadline = time.monotonic() + 300
        while True:
            try:
                await client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("lmdock serve did not start") from None
                await asyncio.sleep(0.3)
        await client.completions.create(model="bench", prompt=prompts[0], max_tokens=n, temperature=0)  # warm-up

        async def one(ids: list[int]) -> Trace:
            tr = Trace()
            if client_kind == "raw":
                await raw_stream(port, {"model": "bench", "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
                                        "ignore_eos": True}, tr)
                return tr
            stream = await client.completions.create(model="bench", prompt=ids, max_tokens=n, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices:
                    tr.arrivals.append(time.perf_counter())
            return tr

        t0 = time.perf_counter()
        traces = await asyncio.gather(*(one(p) for p in prompts))
        label = "openai client" if client_kind == "openai" else "raw SSE client"
        return summarize(f"lmdock serve ({label}, streaming)", list(traces), n * len(prompts), time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on both sides")
    ap.add_argument("--client", choices=["openai", "raw", "both"], default="openai",
                    help="the server side's client: the openai package, a bare SSE reader (as vllm bench serve), or both")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import machine, random_llama, table

    path = str(random_llama())
    prompts = workload(args.requests)
    a = asyncio.run(in_process(path, prompts, args.tokens, args.threads))
    kinds = ["openai", "raw"] if args.client == "both" else [args.client]
    served = [asyncio.run(through_server(path, prompts, args.tokens, args.threads, kind)) for kind in kinds]
    rows = [(r["run"], f"{r['req/s']:.2f}", f"{r['tok/s']:.1f}", f"{r['ttft50']:.0f}", f"{r['ttft99']:.0f}",
             f"{r['itl50']:.1f}", f"{r['itl99']:.1f}") for r in (a, *served)]
    print(f"model: random Llama ~100M, float32, hf backend; {args.requests} concurrent streams, "
          f"{args.tokens} output tokens each, torch threads {args.threads}")
    print(f"machine: {machine()}")
    print(table(rows, ("run", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms")))
    for kind, b in zip(kinds, served):
        print(f"server ({kind} client) / in-process throughput: {b['tok/s'] / a['tok/s']:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
