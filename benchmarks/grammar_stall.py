"""Heavy grammar compiles against everyone else's latency (issue 39): ``lmdock serve`` (stories260K on
lmdock-hf) while four clients send grammars that take llguidance seconds to compile or to compute a
first mask — a strict schema of 10k properties, an ``anyOf`` of 2k objects, a 50k ``choice`` and the
regex ``a{1000000}`` — all at once.  Meanwhile one client polls ``/health`` and another streams an
unconstrained completion; the table gives the worst ``/health`` latency and the longest pause between
two stream chunks, in a quiet window first and then during the compiles (targets: /health within
0.5 s, no pause over 1 s), and what each heavy request got (grammars are checked in worker
processes: a refusal is a 400 that names the grammar).

    HF_HUB_OFFLINE=1 LMDOCK_MODELS=/path/to/models python benchmarks/grammar_stall.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine, table  # noqa: E402


def heavy_bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    props = {f"p{i}": {"type": "integer"} for i in range(10_000)}
    strict = {"name": "big", "strict": True, "schema": {"type": "object", "properties": props}}
    any_of = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]} for i in range(2_000)]}
    ask = [{"role": "user", "content": "Once upon a time"}]
    return {
        "strict schema, 10k properties": ("/v1/chat/completions", {"messages": ask, "response_format": {"type": "json_schema", "json_schema": strict}}),
        "anyOf of 2k objects": ("/v1/completions", {"prompt": "Once upon a time", "guided_json": any_of}),
        "choice of 50k": ("/v1/completions", {"prompt": "Once upon a time", "guided_choice": [f"option number {i}" for i in range(50_000)]}),
        "regex a{1000000}": ("/v1/completions", {"prompt": "Once upon a time", "guided_regex": "a{1000000}"}),
    }


def start_server(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    models = Path(os.environ["LMDOCK_MODELS"]) / "stories260K"
    (tmp / "lmdock.toml").write_text(
        f'default_model = "stories"\n[server]\nport = {port}\nmax_body_bytes = 16777216\n'
        f'[models.stories]\nmodel = "{models}"\nbackend = "hf"\n[models.stories.backends.hf]\nnum_threads = 1\n', encoding="utf-8")
    (tmp / "t.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    exe = Path(sys.executable).with_name("lmdock")
    proc = subprocess.Popen([str(exe), "serve", "--config", str(tmp / "lmdock.toml"), "--chat-template", str(tmp / "t.jinja"),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("lmdock serve did not start")


class Watch:
    """/health latencies and stream chunk gaps until ``stop`` is set."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.health: list[float] = []
        self.gaps: list[float] = []

    def poll_health(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                c.get(f"{self.url}/health")
                self.health.append(time.perf_counter() - t0)
                time.sleep(0.05)

    def stream(self) -> None:
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0.8, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                last = time.perf_counter()
                with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        now = time.perf_counter()
                        self.gaps.append(now - last)
                        last = now
                        if self.stop.is_set():
                            break


def window(url: str, seconds: float, heavy: bool) -> tuple[Watch, list[tuple[str, ...]]]:
    watch = Watch(url)
    threads = [threading.Thread(target=watch.poll_health), threading.Thread(target=watch.stream)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the stream is running
    results: list[tuple[str, ...]] = []
    if heavy:
        def send(name: str, route: str, body: dict[str, Any]) -> None:
            t0 = time.perf_counter()
            r = httpx.post(f"{url}{route}", json={"model": "stories", "max_tokens": 8, **body}, timeout=300)
            message = r.json()["error"]["message"][:90] if r.status_code != 200 else json.dumps(r.json()["choices"][0].get("text", ""))[:40]
            results.append((name, str(r.status_code), f"{time.perf_counter() - t0:.1f}", message))

        senders = [threading.Thread(target=send, args=(n, *rb)) for n, rb in heavy_bodies().items()]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
    else:
        time.sleep(seconds)
    watch.stop.set()
    for t in threads:
        t.join()
    return watch, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="length of the quiet window")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp))
        try:
            quiet, _ = window(url, args.seconds, heavy=False)
            busy, results = window(url, args.seconds, heavy=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print(machine())
    rows = [(name, f"{max(w.health):.3f}", str(len(w.health)), f"{max(w.gaps):.3f}", str(len(w.gaps)))
            for name, w in (("quiet", quiet), ("four heavy compiles", busy))]
    print(table(rows, ("window", "worst /health s", "health polls", "longest stream pause s", "chunks")))
    print(table(sorted(results), ("heavy request", "status", "seconds", "answer")))


if __name__ == "__main__":
    main()
