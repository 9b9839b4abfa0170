"""Soak ``lmdock serve``: many concurrent streams, some clients disconnecting at random, bounded in time.

``--clients`` concurrent clients (default 200) each loop over streaming ``/v1/completions`` requests
(random output lengths) until ``--seconds`` have passed (default 60; ``--seconds 300`` for the
5-minute soak) or ``--max-requests`` were sent; ``--disconnect`` of the requests (default 10%) are
dropped by their client after a random number of chunks.  Reports lost requests (an error status, an
error event, or a stream that ended without ``[DONE]``), hung requests (no end within
``--request-timeout``), the sequences the backend still holds and the requests still in flight once
the load stops, and the server's RSS drift between the end of the warm-up and the end.  Then
``--bursts`` bursts (default 3) of large requests, each 4 with ``n`` = ``--burst-n`` (128) and 4 with
``logprobs`` = 20 and ``n`` = 16 at once, after one such burst as warm-up: the RSS drift from before
the bursts to after them, once the server has been idle a few seconds (issue 28: it stayed at the
peak; target < 5%).

``--attacks`` adds issue 39's hostile clients beside the streams (``benchmarks/soak_attacks.py``):
wrong-typed bodies, 0.9 MB stored responses, many runtime LoRA names, large grammars (the crashing
ones with ``--crash-grammars``, once grammars compile in worker processes).  It warms up with each
attack first (filling the Responses store to its bound, ``--store-max-bytes``), reads the server's
RSS, and ends by checking that ``/health`` is 200, stories260K's known greedy text comes back,
``num_sequences_held`` is 0, no attack got a 5xx, a dropped connection or an unexpected status, and
the RSS is within 10% of its start.
Loopback only; stories260K on the hf backend (``$LMDOCK_MODELS``).

Run: ``HF_HUB_OFFLINE=1 LMDOCK_MODELS=../shared/models python benchmarks/soak.py [--seconds 300] [--attacks]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
sys.path.insert(0, str(Path(__file__).parent))

from soak_attacks import Attacks, make_adapter  # noqa: E402

#: stories260K's greedy continuation of "Once upon a time" (../shared/models/README.md)
DOCUMENTED = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def main_async(args: argparse.Namespace) -> int:
    import httpx

    root = os.environ.get("LMDOCK_MODELS")
    if not root:
        raise SystemExit("set LMDOCK_MODELS to the folder holding stories260K")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="lmdock-soak-"))
    cfg = tmp / "lmdock.toml"
    server = ""
    if args.attacks:  # the agent routes need a template; runtime LoRA on; the store's bound small enough to fill
        (tmp / "t.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
        server = (f'chat_template = "{tmp / "t.jinja"}"\nallow_runtime_lora_updating = true\nmax_body_bytes = 2097152\n'
                  f"response_store_max_bytes = {args.store_max_bytes}\n")
    cfg.write_text(f'default_model = "stories"\n[server]\nport = {port}\n{server}[models.stories]\nmodel = "{Path(root) / "stories260K"}"\n'
                   f'backend = "hf"\nscheduler = {{ max_num_seqs = {args.max_num_seqs} }}\n')
    adapter = make_adapter(Path(root) / "stories260K", tmp / "adapter") if args.attacks else tmp
    exe = Path(sys.executable).with_name("lmdock")
    proc = subprocess.Popen([str(exe), "serve", "--config", str(cfg), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    counts = {"sent": 0, "completed": 0, "disconnected": 0, "lost": 0, "hung": 0}
    rng = random.Random(args.seed)
    health: dict[str, Any] | None = None
    try:
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout)) as http:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("lmdock serve did not start")
                await asyncio.sleep(0.3)
            attacks = Attacks(http, url, adapter, args.crash_grammars, args.attack_pause)
            start_rss = await warm_up(attacks, proc.pid) if args.attacks else 0
            start = time.monotonic()
            stop_at = start + args.seconds
            warm_rss: list[int] = []

            async def one() -> None:
                counts["sent"] += 1
                body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": rng.randint(8, 200),
                        "temperature": 1.0, "stream": True}
                drop_after = rng.randint(1, 20) if rng.random() < args.disconnect else None
                try:
                    async with asyncio.timeout(args.request_timeout):
                        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                            if r.status_code != 200:
                                counts["lost"] += 1
                                return
                            chunks = 0
                            async for line in r.aiter_lines():
                                if not line:
                                    continue
                                if line == "data: [DONE]":
                                    counts["completed"] += 1
                                    return
                                if "error" in json.loads(line[6:]):
                                    counts["lost"] += 1
                                    return
                                chunks += 1
                                if drop_after is not None and chunks >= drop_after:
                                    counts["disconnected"] += 1
                                    return  # leaving the block closes the connection mid-stream
                            if drop_after is None or chunks < drop_after:
                                counts["lost"] += 1  # ended without [DONE]
                except TimeoutError:
                    counts["hung"] += 1
                except httpx.HTTPError:
                    counts["lost"] += 1

            async def client() -> None:
                while time.monotonic() < stop_at and counts["sent"] < args.max_requests:
                    await one()

            async def sample_rss() -> None:
                await asyncio.sleep(min(10.0, args.seconds * 0.2))
                warm_rss.append(rss_kib(proc.pid))

            sampler = asyncio.create_task(sample_rss())
            hostile = ([attacks.wrong_types(stop_at), attacks.big_store(stop_at), attacks.lora_names(stop_at), attacks.grammars(stop_at)]
                       if args.attacks else [])
            await asyncio.gather(*(client() for _ in range(args.clients)), *hostile)
            elapsed = time.monotonic() - start
            await sampler
            # the load has stopped: everything must be released
            settle = time.monotonic() + 5
            while True:
                stats = (await http.get(f"{url}/stats")).json()["stories"]
                if (stats.get("num_sequences_held", 0) == 0 and stats["in_flight"] == 0) or time.monotonic() > settle:
                    break
                await asyncio.sleep(0.1)
            end_rss = rss_kib(proc.pid)
            burst_rss = await bursts(http, url, proc.pid, args)
            stats = (await http.get(f"{url}/stats")).json()["stories"]
            health = await end_checks(http, url, proc.pid, start_rss) if args.attacks else None
    finally:
        proc.terminate()
        code = proc.wait(120)
    drift = (end_rss - warm_rss[0]) / warm_rss[0] * 100 if warm_rss and warm_rss[0] else float("nan")
    print(f"soak: {args.clients} concurrent streaming clients for {elapsed:.0f} s, {args.disconnect:.0%} disconnecting")
    print(f"requests: {counts['sent']} sent, {counts['completed']} completed, {counts['disconnected']} disconnected by the client, "
          f"{counts['lost']} lost, {counts['hung']} hung")
    print(f"after the load: {stats.get('num_sequences_held', 0)} sequences held, {stats['in_flight']} requests in flight")
    print(f"server RSS: {warm_rss[0] / 1024 if warm_rss else float('nan'):.0f} MiB after warm-up, {end_rss / 1024:.0f} MiB at the end "
          f"(drift {drift:+.1f}%; target < 5%)")
    before, peak, after = burst_rss
    burst_drift = (after - before) / before * 100 if before else 0.0
    if args.bursts:
        print(f"bursts: {args.bursts} x (4 x n={args.burst_n}, 4 x logprobs=20 n=16): server RSS {before / 1024:.0f} MiB before, "
              f"{peak / 1024:.0f} MiB at the peak, {after / 1024:.0f} MiB idle after (drift {burst_drift:+.1f}%; target < 5%); "
              f"{stats.get('num_sequences_held', 0)} sequences held")
    print(f"server exit code after SIGTERM: {code}")
    ok = (counts["lost"] == 0 and counts["hung"] == 0 and stats.get("num_sequences_held", 0) == 0 and stats["in_flight"] == 0
          and burst_drift < 5)
    if health is not None:
        print("attacks (outcome counts by kind):", *attacks.report(), sep="\n")
        print(f"end: /health {health['health']}, greedy text {'as documented' if health['greedy'] else 'WRONG'}, "
              f"{health['held']} sequences held, server RSS {start_rss / 1024:.0f} MiB after the warm-up, "
              f"{health['rss'] / 1024:.0f} MiB at the end ({health['drift']:+.1f}%; target within 10%)")
        ok = ok and attacks.failures() == 0 and health["ok"]
    print("healthy" if ok else "NOT healthy")
    return 0 if ok else 1


async def warm_up(attacks: Attacks, pid: int) -> int:
    """Each attack once (the store filled to its bound, adapters loaded and unloaded, grammars compiled),
    then the server's RSS (KiB) once idle: the start the end is held to."""
    forever = float("inf")
    await attacks.wrong_types(time.monotonic())  # one pass
    await attacks.big_store(forever, rounds=24)
    await attacks.lora_names(forever, rounds=1)
    await attacks.grammars(forever, rounds=1)
    await asyncio.sleep(IDLE)
    return rss_kib(pid)


async def end_checks(http: Any, url: str, pid: int, start_rss: int) -> dict[str, Any]:
    """How the server ends: /health, the known greedy text, sequences held, RSS against the start."""
    await asyncio.sleep(IDLE)
    health = (await http.get(f"{url}/health")).status_code
    r = await http.post(f"{url}/v1/completions", json={"model": "stories", "prompt": "Once upon a time", "max_tokens": 40,
                                                         "temperature": 0}, timeout=300)
    greedy = r.status_code == 200 and r.json()["choices"][0]["text"] == DOCUMENTED
    held = (await http.get(f"{url}/stats")).json()["stories"].get("num_sequences_held", 0)
    rss = rss_kib(pid)
    drift = (rss - start_rss) / start_rss * 100
    return {"health": health, "greedy": greedy, "held": held, "rss": rss, "drift": drift,
            "ok": health == 200 and greedy and held == 0 and abs(drift) <= 10}


async def bursts(http: Any, url: str, pid: int, args: argparse.Namespace) -> tuple[int, int, int]:
    """RSS (KiB) before the bursts, at their peak, and once idle after them (zeros with ``--bursts 0``)."""
    if args.bursts == 0:
        return 0, 0, 0
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 1.0}
    wide = {**body, "n": args.burst_n}
    logprobs = {**body, "n": 16, "logprobs": 20}
    peak = 0

    async def one(extra: dict[str, Any]) -> None:
        r = await http.post(f"{url}/v1/completions", json=extra)
        if r.status_code != 200:
            raise SystemExit(f"a burst request failed: {r.status_code} {r.text[:200]}")

    async def burst(requests: list[dict[str, Any]]) -> None:
        nonlocal peak
        task = asyncio.gather(*(one(b) for b in requests))
        while not task.done():
            peak = max(peak, rss_kib(pid))
            await asyncio.wait({task}, timeout=0.2)
        await task

    await burst([logprobs] * 4)  # warm-up: the logprobs path's one-time costs
    await asyncio.sleep(IDLE)
    before = rss_kib(pid)
    for _ in range(args.bursts):
        await burst([wide] * 4 + [logprobs] * 4)
    await asyncio.sleep(IDLE)
    return before, peak, rss_kib(pid)


#: Seconds to leave the server idle before reading its RSS (it trims what it freed after a quiet second).
IDLE = 5.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to keep the load on (300 for the 5-minute soak)")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--disconnect", type=float, default=0.10, help="fraction of requests their client drops mid-stream")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds after which a request counts as hung")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="the engine's batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bursts", type=int, default=3, help="bursts of large-n and logprobs requests after the load")
    ap.add_argument("--burst-n", type=int, default=128, help="n of the large requests (at most [server] max_n)")
    ap.add_argument("--attacks", action="store_true", help="add issue 39's hostile clients and end with the health checks")
    ap.add_argument("--crash-grammars", action="store_true",
                    help="with --attacks: also the grammars that crash llguidance (400s once grammars compile in workers)")
    ap.add_argument("--attack-pause", type=float, default=0.25, help="with --attacks: seconds between one attacker's requests")
    ap.add_argument("--store-max-bytes", type=int, default=16 * 2**20, help="with --attacks: [server] response_store_max_bytes")
    sys.exit(asyncio.run(main_async(ap.parse_args())))


if __name__ == "__main__":
    main()
