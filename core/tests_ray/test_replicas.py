"""``lmdock serve --replicas 2``: stories260K (hf) as two Ray Serve replicas behind one ``lmdock serve``,
on a local Ray cluster, driven by the openai client over 127.0.0.1."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import DOCUMENTED, Server


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("replicas"), args=("--replicas", "2"), env={"RAY_ADDRESS": None})
    yield s
    s.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _complete(server: Server) -> str:
    reply = _client(server).completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0)
    return reply.choices[0].text


def _served(server: Server) -> dict[str, int]:
    return httpx.get(f"{server.url}/stats", timeout=10).json()["stories"]["replica_requests"]


def _replica_pids(root: int) -> list[int]:
    """The Ray Serve replica processes under ``root`` (the server started the local cluster)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
    found = []
    for pid in parents:
        try:
            title = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        up = pid
        while up in parents and up != root:
            up = parents[up]
        if up == root and title.startswith(b"ray::ServeReplica"):
            found.append(pid)
    return found


def test_the_exact_greedy_text_through_a_replica(replicas: Server) -> None:
    """A server started with ``--replicas 2`` answers with the exact greedy text."""
    assert _complete(replicas) == DOCUMENTED
    stream = _client(replicas).completions.create(model="stories", prompt="Once upon a time", max_tokens=40, temperature=0,
                                                  stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == DOCUMENTED  # streamed from the replica


def test_grammars_constrain_through_a_replica_and_a_crashing_one_is_a_400(replicas: Server) -> None:
    """The front end checks the grammar in its worker processes (issue 39), then the replica compiles it
    off its event loop; 5,000 chained Lark rules crash the check's worker, not a process that serves."""
    reply = _client(replicas).completions.create(model="stories", prompt="Once upon a time", max_tokens=10,
                                                 extra_body={"guided_choice": ["yes", "no"]})
    assert reply.choices[0].text in ("yes", "no")
    lark = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(5000)) + 'r5000: "x"\n'
    r = httpx.post(f"{replicas.url}/v1/completions", json={"model": "stories", "prompt": "Once", "max_tokens": 5,
                                                           "guided_grammar": lark}, timeout=120)
    assert r.status_code == 400 and "crashed the grammar compiler" in r.json()["error"]["message"], r.text
    assert _complete(replicas) == DOCUMENTED


def test_40_concurrent_requests_all_succeed_on_both_replicas(replicas: Server) -> None:
    before = _served(replicas)
    with ThreadPoolExecutor(40) as pool:
        texts = list(pool.map(lambda _: _complete(replicas), range(40)))
    assert texts == [DOCUMENTED] * 40
    after = _served(replicas)
    counts = {r: after[r] - before.get(r, 0) for r in after}
    assert sum(counts.values()) == 40
    assert len([c for c in counts.values() if c > 0]) == 2, counts  # both replicas served some


def test_metrics_label_each_replica_and_the_front_end_holds_no_model(replicas: Server) -> None:
    text = httpx.get(f"{replicas.url}/metrics", timeout=10).text
    served = {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith('lmdock:replica_requests_total{model_name="stories"')}
    assert served == {r: float(n) for r, n in _served(replicas).items()} and len(served) == 2, served
    assert 'lmdock:replica_kv_cache_usage_perc{model_name="stories",replica=' in text
    assert 'lmdock:num_requests_running{model_name="stories"} 0.0' in text  # the sum over the replicas, all idle
    # the model (torch and its weights) is loaded in the replicas only: the front end has the tokenizer
    assert "libtorch" not in (Path("/proc") / str(replicas.proc.pid) / "maps").read_text()


def test_a_dead_replica_fails_its_requests_with_503_and_the_service_recovers(replicas: Server) -> None:
    pids = _replica_pids(replicas.proc.pid)
    assert len(pids) == 2, pids
    client = _client(replicas)

    def one(i: int) -> str:
        # long requests, so that they are still running in the replica when it dies; every other one streams
        args = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0}
        try:
            if i % 2:
                return "".join(ch.choices[0].text for ch in client.completions.create(**args, stream=True) if ch.choices)
            return client.completions.create(**args).choices[0].text
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.response.headers["retry-after"], exc
            assert "replica" in exc.response.json()["error"]["message"]
            return "503"
        except openai.APIError as exc:  # a stream under way ends with an error event naming the cause
            assert i % 2 and "replica serving the request stopped" in exc.message, exc
            return "cut"

    before = _served(replicas)
    with ThreadPoolExecutor(16) as pool:
        results = pool.map(one, range(16))
        started: dict[str, int] = {}
        deadline = time.monotonic() + 120  # bounded: a regression fails here instead of hanging CI
        while sum(started.values()) < 16:  # every request has its first tokens
            assert time.monotonic() < deadline, f"16 requests never all started: {started}"
            time.sleep(0.05)
            now = _served(replicas)
            started = {r: now[r] - before.get(r, 0) for r in now}
        assert len([n for n in started.values() if n]) == 2, started  # each replica runs some
        os.kill(pids[0], signal.SIGKILL)
        outcomes = list(results)  # every request answered: none hangs
    assert all(o in ("503", "cut") or o.startswith(DOCUMENTED) for o in outcomes), outcomes
    lost = [o for o in outcomes if o in ("503", "cut")]
    assert lost and len(lost) < 16, outcomes  # the dead replica's requests fail, clearly; the other's complete
    assert _complete(replicas) == DOCUMENTED  # the other replica (and Ray's replacement) go on serving


def test_requests_sharing_a_long_prefix_land_on_one_replica(replicas: Server) -> None:
    prefix = "Once upon a time" + DOCUMENTED  # 45 tokens: past the 32 the router keys on
    before = _served(replicas)
    with ThreadPoolExecutor(10) as pool:
        texts = list(pool.map(lambda i: _client(replicas).completions.create(
            model="stories", prompt=f"{prefix} Then {i}", max_tokens=4, temperature=0).choices[0].text, range(10)))
    assert all(texts)
    after = _served(replicas)
    counts = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
    assert list(counts.values()) == [10], counts  # all ten on the replica holding the prefix


def test_sigterm_drains_and_exits_0(replicas: Server) -> None:
    replicas.proc.send_signal(signal.SIGTERM)
    assert replicas.proc.wait(120) == 0, replicas.output()

