"""``lmdock serve --replicas 2`` against one Ray Serve replica and plain ``lmdock serve``: the same
streamed workload, model and cores, in the same run.

32 concurrent streaming ``/v1/completions`` requests (token-id prompts of 16-128 tokens, each with a
prefix of its own, 64 greedy output tokens each, EOS ignored) on the ~100M random-weight Llama
(benchmarks/_common.py) on the hf backend, read by the bare SSE client of benchmarks/_common.py.
Each server, one after the other, in a process group of its own on 127.0.0.1 (``RAY_ADDRESS``
unset, so ``--replicas 2`` starts a local Ray cluster of its own):

- ``plain``: ``lmdock serve``, torch threads = ``--cores``;
- ``replicas1``: ``lmdock serve`` with one Ray Serve replica, torch threads = ``--cores``
  (``[server] autoscaling = { min = 1, max = 1 }``: ``--replicas 1`` means no Ray), so its ratio to
  ``plain`` is the Ray path's own cost (front end, routing, streaming through an actor);
- ``replicas2``: ``lmdock serve --replicas 2``, each replica ``--cores`` / 2 torch threads (the same
  cores in all), requests routed by lmdock's prefix-affinity router (a prompt of 32 tokens or more
  goes to the replica its first 32 tokens hash to, a shorter one to the less loaded of two);
- ``plain2``: two plain ``lmdock serve`` processes of ``--cores`` / 2 threads each, the client sending
  them alternate requests: the same engines and threads as ``replicas2`` without Ray, so
  ``replicas2 / plain2`` is what the Ray path costs (its front end, routing and streaming through
  actors), and ``replicas2 / plain`` what splitting the cores into replicas costs on top.

Each setup in turn is started, warmed up at the same concurrency (2 tokens each, prompts of their
own), timed for ``--rounds`` (3) rounds (round r streams the prompts of seed r), each bounded by
``--timeout``, and stopped (SIGTERM to its process group, SIGKILL after 60 s; also on error); every
stream's token count is checked (its usage event).  That is one cycle; ``--cycles`` (3) of them run,
the order reversed every other cycle, so that a machine whose load drifts (a shared one) weighs on
every setup.  Printed: the command line, the machine and its load, per setup its median round over
all cycles (output tok/s, TTFT and ITL p50/p99, the CPU seconds the servers and all their descendants,
Ray's processes included, spent in it, of which the ``lmdock serve`` processes' own), its median start
time and (``replicas2``) the requests each replica served per round (``/stats``); then each ratio of
median throughputs cycle by cycle, with its median and spread.  Needs ``lmdock[serve,ray]`` and
``lmdock-hf``.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/replicas.py [--requests 32] [--tokens 64] [--rounds 3] [--cycles 3] [--cores N] [--servers plain,replicas1,replicas2,plain2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    Trace,
    machine,
    median_round,
    random_llama,
    raw_stream,
    start_hf_server,
    stop,
    summarize,
    table,
    tree_cpu,
    wait_up,
    workload,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Setup:
    name: str
    label: str
    processes: int  # lmdock serve processes, the client alternating between them
    engines: int  # engines in all (a process's replicas each run one)
    threads: int  # torch threads of each engine
    args: tuple[str, ...] = ()
    server_table: str = ""


def setups(cores: int) -> dict[str, Setup]:
    half = max(1, cores // 2)
    return {
        "plain": Setup("plain", "lmdock serve", 1, 1, cores),
        # one replica is served without Ray unless the autoscaler holds it (at one)
        "replicas1": Setup("replicas1", "lmdock serve, 1 Ray Serve replica", 1, 1, cores,
                           server_table="autoscaling = { min = 1, max = 1 }\n"),
        "replicas2": Setup("replicas2", "lmdock serve --replicas 2 (Ray Serve)", 1, 2, half, ("--replicas", "2")),
        "plain2": Setup("plain2", "2 x lmdock serve, requests alternated", 2, 2, half),
    }


def replica_requests(port: int) -> dict[str, int]:
    """Requests each replica has served so far (``/stats``; empty without replicas).  No proxy: the
    server is on 127.0.0.1, whatever ``http_proxy`` says."""
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"http://127.0.0.1:{port}/stats", timeout=30) as reply:
        return dict(json.load(reply)["bench"].get("replica_requests", {}))


async def measure(setup: Setup, path: str, args: argparse.Namespace, cycle: int) -> dict[str, Any]:
    """Start ``setup``'s servers, warm them up, time ``args.rounds`` rounds, stop them (also on error).
    Returns the rounds and the seconds the servers took to start."""
    n, requests = args.tokens, args.requests
    servers: list[tuple[subprocess.Popen[bytes], int, Path]] = []
    try:
        t0 = time.monotonic()
        for _ in range(setup.processes):
            tmp = Path(tempfile.mkdtemp(prefix=f"lmdock-bench-{setup.name}-"))
            proc, port = start_hf_server(path, requests, setup.threads, tmp, setup.args, env={"RAY_ADDRESS": None},
                                         server_table=setup.server_table)
            servers.append((proc, port, tmp))
        for proc, port, tmp in servers:
            await wait_up(proc, port, args.start_timeout, setup.label, tmp / "server.log")
        started = time.monotonic() - t0
        ports = [port for _, port, _ in servers]

        async def one(i: int, ids: list[int], tokens: int) -> Trace:
            tr = Trace()
            await raw_stream(ports[i % len(ports)], {"model": "bench", "prompt": ids, "max_tokens": tokens, "temperature": 0,
                                                     "stream": True, "ignore_eos": True,
                                                     "stream_options": {"include_usage": True}}, tr)
            return tr

        async def run(prompts: list[list[int]], tokens: int, what: str) -> list[Trace]:
            try:
                return list(await asyncio.wait_for(asyncio.gather(*(one(i, p, tokens) for i, p in enumerate(prompts))),
                                                   args.timeout))
            except asyncio.TimeoutError:
                raise SystemExit(f"{setup.label}: the {what} took more than {args.timeout:.0f} s") from None

        await run(workload(requests, seed=1000), 2, "warm-up")
        rounds = []
        for r in range(args.rounds):
            before_split = replica_requests(ports[0])
            before = [tree_cpu(proc.pid) for proc, _, _ in servers]
            t1 = time.perf_counter()
            traces = await run(workload(requests, seed=r), n, f"round {r}")
            wall = time.perf_counter() - t1
            after = [tree_cpu(proc.pid) for proc, _, _ in servers]
            got = [t.tokens for t in traces]
            if any(g != n for g in got):
                raise SystemExit(f"{setup.label}: streams returned {sorted(set(map(str, got)))} completion tokens, expected {n}")
            result = summarize(setup.label, traces, n * requests, wall)
            result["cpu"] = sum(cpu - b.get(pid, 0.0) for b, a in zip(before, after) for pid, cpu in a.items())
            result["cpu_front"] = sum(a.get(proc.pid, 0.0) - b.get(proc.pid, 0.0) for (proc, _, _), b, a in zip(servers, before, after))
            split = replica_requests(ports[0])
            result["split"] = sorted((split[k] - before_split.get(k, 0) for k in split), reverse=True)
            rounds.append(result)
            print(f"cycle {cycle} {setup.name} round {r}: {result['tok/s']:.1f} tok/s, TTFT p50 {result['ttft50']:.0f} ms, "
                  f"{result['cpu']:.1f} CPU s" + (f", requests per replica {result['split']}" if result["split"] else ""),
                  flush=True)
        return {"rounds": rounds, "start_s": started}
    finally:
        for proc, _, _ in servers:
            stop(proc)


#: the ratios printed, each with what it measures
RATIOS = {
    ("replicas1", "plain"): "the Ray path's own cost: one engine of all the threads, through Ray or not",
    ("replicas2", "replicas1"): "2 Ray replicas of half the threads each against one engine of all of them",
    ("replicas2", "plain"): "the Ray path and the split into replicas together",
    ("replicas2", "plain2"): "the Ray path's own cost: the same engines and threads, without Ray",
}


def ratio_lines(cycles: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Each ratio of median throughputs, cycle by cycle (the setups of a cycle ran one after the other)."""
    out = []
    for (a, b), note in RATIOS.items():
        if a in cycles[0] and b in cycles[0]:
            xs = [median_round(c[a]["rounds"])["tok/s"] / median_round(c[b]["rounds"])["tok/s"] for c in cycles]
            out.append(f"{a} / {b} throughput by cycle: {', '.join(f'{x:.3f}' for x in xs)}; median {statistics.median(xs):.3f}, "
                       f"spread {min(xs):.3f}-{max(xs):.3f} ({note})")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="concurrent streams per round")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per setup and cycle")
    ap.add_argument("--cycles", type=int, default=3,
                    help="times each setup is started and timed, the order reversed every other cycle")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="torch threads of a single engine; replicas2 and plain2 give each of their two engines half")
    ap.add_argument("--servers", default="plain,replicas1,replicas2,plain2",
                    help="which setups to run, in this order (plain, replicas1, replicas2, plain2)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to start")
    ap.add_argument("--timeout", type=float, default=600, help="seconds the warm-up, and each timed round, may take")
    args = ap.parse_args(argv)
    known = setups(args.cores)
    order = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in order if s not in known]
    if unknown or not order:
        ap.error(f"--servers: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    if min(args.rounds, args.cycles, args.requests, args.tokens) < 1:
        ap.error("--rounds, --cycles, --requests and --tokens must be at least 1")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    path = str(random_llama())
    cycles: list[dict[str, dict[str, Any]]] = []
    for c in range(args.cycles):
        cycles.append({name: asyncio.run(measure(known[name], path, args, c)) for name in (order if c % 2 == 0 else order[::-1])})
    results = {}
    for name in order:  # each setup's median round over every cycle, and its median start time
        rounds = [r for c in cycles for r in c[name]["rounds"]]
        results[name] = {**median_round(rounds), "start_s": statistics.median(c[name]["start_s"] for c in cycles),
                         "rounds": [r["tok/s"] for r in rounds], "splits": [r["split"] for r in rounds]}
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(f"model: random Llama ~100M, float32, hf backend; {args.requests} concurrent streams x {args.tokens} output "
          "tokens (token-id prompts of 16-128 tokens, greedy, EOS ignored), raw SSE client; max_num_seqs "
          f"{args.requests} per engine")
    print(f"machine: {machine()}; cores given to each setup: {args.cores}; load average at start {load}, at end {load_end}")
    print(f"{args.cycles} cycles of {args.rounds} timed rounds per setup (round r: the prompts of seed r), the setups one "
          f"after the other in the order {', '.join(order)}, reversed every other cycle; per setup its median round of all:")
    rows = [(r["run"], f"{known[name].engines} x {known[name].threads}",
             f"{r['tok/s']:.1f}", f"{r['ttft50']:.0f}", f"{r['ttft99']:.0f}", f"{r['itl50']:.1f}", f"{r['itl99']:.1f}",
             f"{r['cpu']:.1f}", f"{r['cpu_front']:.1f}", f"{r['start_s']:.0f}") for name, r in results.items()]
    print(table(rows, ("setup", "engines x torch threads", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                       "CPU s", "front-end CPU s", "start s")))
    for name, r in results.items():
        split = f"; requests per replica by round: {r['splits']}" if any(r["splits"]) else ""
        print(f"{name}: output tok/s by round: {', '.join(f'{x:.1f}' for x in r['rounds'])}{split}")
    for line in ratio_lines(cycles):
        print(line)


if __name__ == "__main__":
    main()
