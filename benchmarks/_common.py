"""Helpers shared by the benchmark scripts: the random-weight model, the machine, the table, and for the
server benchmarks a streamed workload, a bare SSE client and ``lmdock serve`` subprocesses on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: A Llama of about 100M parameters (speed does not depend on trained weights).  The vocabulary is
#: stories260K's, so its tokenizer serves and every generated id decodes.
LLAMA_100M = {
    "hidden_size": 768,
    "intermediate_size": 2560,
    "num_hidden_layers": 13,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def models_dir() -> Path:
    root = os.environ.get("LMDOCK_MODELS")
    if root is None:
        from lmdock import load_config

        return Path(load_config(Path(__file__).parents[1] / "lmdock.toml").model("stories").model).parent
    return Path(root)


def random_llama(seed: int = 0, config: dict[str, Any] | None = None, name: str = "llama-100m") -> Path:
    """Build (once, cached on disk under ``NAME-seedSEED``) a random-weight Llama of ``config`` (default
    :data:`LLAMA_100M`) with stories260K's tokenizer files, and return its folder."""
    cache = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench"))
    out = cache / f"{name}-seed{seed}"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(config or LLAMA_100M))).eval()
    tmp = out.with_suffix(".tmp")
    model.save_pretrained(tmp)
    stories = models_dir() / "stories260K"
    for file in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories / file, tmp / file)
    tmp.rename(out)
    return out


def machine() -> str:
    import lmdock
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, lmdock {lmdock.__version__}, Python {platform.python_version()}"
    )


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def spawn(script: str, side: str, model: Path | str, tokens: int) -> dict[str, Any]:
    """Run ``script --worker SIDE --model MODEL --tokens N`` in a subprocess; return the JSON it
    prints after ``RESULT `` (each side of a benchmark gets a process of its own)."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, script, "--worker", side, "--model", str(model), "--tokens", str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{side} on {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


# -- serving benchmarks: the workload, the client, the server process ---------------------------------


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of 16-128 tokens (BOS, then random ids): seed r gives round r's, so rounds share
    no prefix."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(16, 128) - 1)] for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


class Trace:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.arrivals: list[float] = []
        self.tokens: int | None = None  # completion_tokens of the stream's usage event, when asked for

    def ttft(self) -> float:
        return self.arrivals[0] - self.start

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def summarize(name: str, traces: list[Trace], tokens: int, wall: float) -> dict[str, Any]:
    ttfts = [t.ttft() * 1000 for t in traces]
    itls = [x * 1000 for t in traces for x in t.itls()]
    return {"run": name, "req/s": len(traces) / wall, "tok/s": tokens / wall, "ttft50": pct(ttfts, 50), "ttft99": pct(ttfts, 99),
            "itl50": pct(itls, 50), "itl99": pct(itls, 99), "wall": wall}


async def raw_stream(port: int, body: dict[str, Any], tr: Trace) -> None:
    """One streaming POST /v1/completions over a bare asyncio connection, as ``vllm bench serve``
    reads SSE with aiohttp: an arrival per ``data:`` event with a non-empty ``choices`` list (uvicorn
    sends each event in one chunk, so an event is one line here; lmdock serve and vLLM's server both
    write compact JSON, ``"choices":[{...``), no JSON parsing of the chunks.  The usage event (an empty
    ``choices`` list, sent last when ``stream_options.include_usage`` is asked for) is parsed for the
    stream's ``completion_tokens``."""
    import json

    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise SystemExit(f"the server answered {status!r}")
    try:
        while line := await reader.readline():
            if line.startswith(b"data: {"):
                if b'"choices":[{' in line:
                    tr.arrivals.append(time.perf_counter())
                elif b'"choices":[]' in line and b'"usage":{' in line:
                    tr.tokens = int(json.loads(line[6:])["usage"]["completion_tokens"])
    finally:
        writer.close()


def start_hf_server(path: str, requests: int, threads: int, tmp: Path, args: Sequence[str] = (),
                    env: dict[str, str | None] | None = None, server_table: str = "") -> tuple[subprocess.Popen[bytes], int]:
    """``lmdock serve`` on the hf backend (model ``bench``, ``max_num_seqs`` = ``requests``, ``threads`` torch
    threads) in a process group of its own on 127.0.0.1, ``args`` added to its command line, ``server_table``
    to its config's ``[server]`` and ``env`` over the environment (None: unset); its output goes to
    ``tmp/server.log``.  Returns it and its port."""
    port = free_port()
    cfg = tmp / "lmdock.toml"
    cfg.write_text(f'default_model = "bench"\n[server]\nhost = "127.0.0.1"\nport = {port}\n{server_table}[models.bench]\nmodel = "{path}"\n'
                   f'backend = "hf"\nscheduler = {{ max_num_seqs = {requests} }}\n[models.bench.backends.hf]\nnum_threads = {threads}\n')
    exe = Path(sys.executable).with_name("lmdock")
    environ = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    with open(tmp / "server.log", "wb") as log:
        proc = subprocess.Popen([str(exe), "serve", "--config", str(cfg), "--log-level", "warning", *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environ, start_new_session=True)
    return proc, port


async def wait_up(proc: subprocess.Popen[bytes], port: int, timeout: float, label: str, log: Path | None = None) -> float:
    """Wait until the server's ``GET /v1/models`` answers 200; return the seconds that took.  Exit, naming
    ``label`` and the tail of ``log``, when the server dies or ``timeout`` seconds pass first."""
    t0 = time.monotonic()
    while await http_status(port, "/v1/models") != 200:
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.is_file() else ""
            raise SystemExit(f"{label} did not start within {timeout:.0f} s (exit code {proc.poll()})"
                             + (f"; log {log}:\n{tail}" if log is not None else ""))
        await asyncio.sleep(0.5)
    return time.monotonic() - t0


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median throughput (the lower middle one for an even count)."""
    ordered = sorted(rounds, key=lambda x: x["tok/s"])
    return ordered[(len(ordered) - 1) // 2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (the server and vLLM's engine-core child), SIGKILL after 60 s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (an orphaned engine core)
    except ProcessLookupError:
        pass
    proc.wait()


async def http_status(port: int, path: str) -> int | None:
    """The status code of ``GET path``, or None when nothing answers yet."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        writer.write(b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" % path.encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        parts = line.split()
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    except (OSError, asyncio.TimeoutError):
        return None
    finally:
        writer.close()


def processes() -> dict[int, tuple[int, int, float]]:
    """Each live process's parent, process group and CPU seconds (user + system) so far (Linux /proc;
    empty elsewhere)."""
    out: dict[int, tuple[int, int, float]] = {}
    if not os.path.isdir("/proc"):
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(pid)] = (int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / tick)
    return out


def group_cpu(pgid: int) -> dict[int, float]:
    """CPU seconds so far of each live process in process group ``pgid`` (empty without /proc)."""
    return {pid: cpu for pid, (_, group, cpu) in processes().items() if group == pgid}


def tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds so far of process ``root`` and each live descendant (empty without /proc): Ray starts
    its workers in sessions of their own, out of the server's process group, but under it."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    out, todo = {}, [root] if root in procs else []
    while todo:
        pid = todo.pop()
        out[pid] = procs[pid][2]
        todo += children.get(pid, [])
    return out
