"""``lmdock.ModelPool`` in a process of its own, on the real hf engine: stories260K under two config
names with different options, one loaded at a time.  (The policy in detail: core/tests/test_model_pool.py;
the server over it: core/tests_serve/test_pool.py.)"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from lmdock import ModelPool, PoolFullError, SamplingParams
from stories_facts import GREEDY_40_TEXT, PROMPT

GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


def _config(tmp_path: Path, stories: str) -> Path:
    path = tmp_path / "lmdock.toml"
    path.write_text(
        "[server]\nmax_loaded_models = 1\n"
        f'[models.a]\nmodel = "{stories}"\nbackend = "hf"\n[models.a.backends.hf]\nnum_threads = 1\n'
        f'[models.b]\nmodel = "{stories}"\nbackend = "hf"\nkeep_alive = 0\n[models.b.build]\nmax_seq_len = 128\n',
        encoding="utf-8")
    return path


def test_two_models_one_at_a_time_each_held_while_used(stories: str, tmp_path: Path) -> None:
    loads: list[str] = []
    with ModelPool(_config(tmp_path, stories), on_load=lambda m, seconds: loads.append(m.name)) as pool:
        assert pool.max_loaded_models == 1
        with pool.use("a") as a:
            assert a.generate(PROMPT, GREEDY)[0].outputs[0].text == GREEDY_40_TEXT
            assert a.backend.name == "hf"
            # b needs a's place, and a is in use: refused, naming a; a keeps answering
            with pytest.raises(PoolFullError, match=r"max_loaded_models is 1.*'a' \(1 requests"):
                pool.acquire("b")
            assert a.generate(PROMPT, GREEDY)[0].outputs[0].text == GREEDY_40_TEXT

        answers: list[str] = []

        def use_b() -> None:
            with pool.use("b") as b:
                answers.append(b.generate(PROMPT, GREEDY)[0].outputs[0].text)

        threads = [threading.Thread(target=use_b) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [GREEDY_40_TEXT] * 4  # a was idle: unloaded to make room, b loaded once for four users
        assert loads == ["a", "b"] and pool.models()["a"]["state"] == "unloaded"
        # b's keep_alive is 0: the reaper unloads it once the last user lets go
        for _ in range(600):
            if pool.models()["b"]["state"] == "unloaded":
                break
            threading.Event().wait(0.05)
        assert pool.models()["b"]["state"] == "unloaded"
        with pool.use("a") as a:
            assert a.generate(PROMPT, GREEDY)[0].outputs[0].text == GREEDY_40_TEXT
        assert loads == ["a", "b", "a"]
