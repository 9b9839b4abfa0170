"""``lmdock.ModelPool``'s policy (``lmdock/_models/pool.py``): loading on first use, one load for concurrent
first uses, LRU idle eviction under ``max_loaded_models`` and a measured memory budget, holds,
``pin``, ``keep_alive``, failed loads.  Plumbing only: every model here is the FAKE backend (the real
engine's run is in plugins/hf/tests/test_model_pool_hf.py, the server's in core/tests_serve/test_pool.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import FakePlugin
from lmdock import LLM, ModelBusyError, ModelPool, PoolFullError, SamplingParams

MIB = 2**20


def _fake(ballast_mib: int = 0, calls: list[str] | None = None, name: str = "m") -> Callable[[], Any]:
    """A loader of the FAKE backend's LLM; ``ballast_mib``: that much memory, resident, that the LLM keeps."""
    def load() -> Any:
        if calls is not None:
            calls.append(name)
        llm = LLM("m", backend="fake")
        llm.ballast = b"\x01" * (ballast_mib * MIB)  # bytes are written: resident, unlike a fresh bytearray
        return llm
    return load


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def _states(pool: ModelPool) -> dict[str, str]:
    return {name: m["state"] for name, m in pool.models().items()}


def test_use_loads_on_first_use_and_the_least_recently_used_idle_model_goes(fake: FakePlugin) -> None:
    calls: list[str] = []
    with ModelPool(max_loaded_models=2) as pool:
        for name in "abc":
            pool.add(name, _fake(calls=calls, name=name))
        assert _states(pool) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
        with pool.use("a") as llm:
            assert llm.generate("x", SamplingParams(max_new_tokens=3))[0].outputs[0].token_ids
        with pool.use("b"):
            pass
        with pool.use("a"):  # a is used after b: b is the least recently used
            pass
        with pool.use("c"):
            assert _states(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert calls == ["a", "b", "c"]
        assert pool.models()["b"]["memory_bytes"] is not None  # measured at its load, then at its unload


def test_concurrent_first_uses_share_one_load(fake: FakePlugin) -> None:
    calls: list[str] = []
    gate = threading.Event()

    def slow() -> Any:
        gate.wait(10)
        return _fake(calls=calls)()

    with ModelPool() as pool:
        pool.add("a", slow)
        futures = [pool.hold("a") for _ in range(8)]
        assert _states(pool) == {"a": "loading"} and not any(f.done() for f in futures)
        gate.set()
        assert len({id(f.result(10)) for f in futures}) == 1
        assert calls == ["m"] and pool.models()["a"]["holds"] == 8
        for _ in futures:
            pool.release("a")
        with pytest.raises(ValueError, match="not held"):
            pool.release("a")


def test_a_held_model_is_never_evicted_and_the_error_names_it(fake: FakePlugin) -> None:
    with ModelPool(max_loaded_models=1) as pool:
        pool.add("a", _fake())
        pool.add("b", _fake())
        pool.acquire("a")
        with pytest.raises(PoolFullError, match=r"cannot load model 'b': 1 models are loaded and max_loaded_models is 1.*'a' \(1 requests"):
            pool.acquire("b")
        assert _states(pool) == {"a": "loaded", "b": "unloaded"} and pool.models()["b"]["holds"] == 0
        with pytest.raises(ModelBusyError, match="1 requests in flight"):
            pool.unload("a")
        pool.release("a")
        with pool.use("b"):
            assert _states(pool) == {"a": "unloaded", "b": "loaded"}


def test_a_failed_load_fails_its_waiters_with_the_loaders_error_and_the_others_serve(fake: FakePlugin) -> None:
    gate = threading.Event()
    tries: list[int] = []

    def broken() -> Any:
        tries.append(1)
        gate.wait(10)
        raise OSError("no weights in /nowhere")

    with ModelPool(max_loaded_models=2) as pool:
        pool.add("bad", broken)
        pool.add("a", _fake())
        futures = [pool.hold("bad") for _ in range(3)]
        gate.set()
        for f in futures:
            with pytest.raises(OSError, match="no weights in /nowhere"):
                f.result(10)
            pool.release("bad")
        assert tries == [1] and _states(pool) == {"bad": "unloaded", "a": "unloaded"}
        with pool.use("a") as llm:
            assert llm.generate("x", SamplingParams(max_new_tokens=2))[0].outputs[0].token_ids
        with pytest.raises(OSError):  # the next use tries again
            pool.acquire("bad")
        assert tries == [1, 1]


def test_keep_alive_zero_unloads_once_let_go_and_a_pinned_model_stays(fake: FakePlugin) -> None:
    with ModelPool(max_loaded_models=2) as pool:
        pool.add("p", _fake(), pin=True)
        pool.add("k", _fake(), keep_alive=0)
        pool.add("s", _fake(), keep_alive="5m")
        with pool.use("p"), pool.use("k"):
            time.sleep(0.05)
            assert _states(pool) == {"p": "loaded", "k": "loaded", "s": "unloaded"}  # held: keep_alive waits
        _until(lambda: _states(pool)["k"] == "unloaded", "k unloaded once let go (keep_alive 0)")
        with pytest.raises(ModelBusyError, match="pinned"):
            pool.unload("p")
        with pytest.raises(ValueError, match="keep_alive: model 'p' is pinned"):
            pool.hold("p", keep_alive=1)
        with pool.use("s", keep_alive=0):  # a use's keep_alive is the model's from then on
            pass
        _until(lambda: _states(pool)["s"] == "unloaded", "s unloaded after a use with keep_alive 0")
        assert pool.models()["s"]["keep_alive"] == 0 and _states(pool)["p"] == "loaded"


def test_a_memory_budget_is_measured_and_idle_models_make_room(fake: FakePlugin) -> None:
    _fake()().shutdown()  # the backend's imports are in the process before the first measure
    with ModelPool(memory_budget_gib=80 / 1024) as pool:  # 80 MiB: one 48 MiB model fits, two do not
        pool.add("a", _fake(48))
        pool.add("b", _fake(48))
        pool.load("a")
        assert 40 * MIB < pool.models()["a"]["memory_bytes"] < 80 * MIB
        with pool.use("b"):
            assert _states(pool) == {"a": "unloaded", "b": "loaded"}
            assert pool.models()["a"]["memory_bytes"] > 40 * MIB  # what its unload gave back
            with pytest.raises(PoolFullError, match=r"memory_budget_gib is 0.078125.*'b' \(1 requests"):
                pool.acquire("a")
        assert _states(pool) == {"a": "unloaded", "b": "loaded"}


def test_a_config_files_models_with_their_pin_keep_alive_and_server_bounds(fake: FakePlugin, tmp_path: Path) -> None:
    (tmp_path / "lmdock.toml").write_text(
        "[server]\nmax_loaded_models = 2\n"
        '[models.p]\nmodel = "m"\nbackend = "fake"\npin = true\n'
        '[models.k]\nmodel = "m"\nbackend = "fake"\nkeep_alive = 30\n'
        '[models.q]\nmodel = "m"\nbackend = "fake"\n', encoding="utf-8")
    with ModelPool(tmp_path / "lmdock.toml") as pool:
        assert pool.max_loaded_models == 2 and pool.memory_budget_gib is None
        assert _states(pool) == {"p": "loaded", "k": "unloaded", "q": "unloaded"}  # pinned: loaded at start
        assert pool.models()["k"]["keep_alive"] == 30
        with pool.use("k"):
            pass
        with pool.use("q"):
            assert _states(pool) == {"p": "loaded", "k": "unloaded", "q": "loaded"}
    assert _states(pool) == {"p": "unloaded", "k": "unloaded", "q": "unloaded"}  # close() shut them down
    assert fake.engines and all(e.closed for e in fake.engines)
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire("p")


def test_bad_arguments_name_themselves(fake: FakePlugin) -> None:
    with pytest.raises(ValueError, match="memory_budget_gib must be > 0"):
        ModelPool(memory_budget_gib=0)
    with pytest.raises(ValueError, match="max_loaded_models must be an int >= 1"):
        ModelPool(max_loaded_models=0)
    with ModelPool() as pool:
        pool.add("a", _fake())
        with pytest.raises(ValueError, match="in the pool already"):
            pool.add("a", _fake())
        with pytest.raises(KeyError, match="no model named 'z' in the pool; models: a"):
            pool.acquire("z")
        with pytest.raises(ValueError, match="'soon' is not a duration"):
            pool.hold("a", keep_alive="soon")
