"""lmdock-mlx on the real stories260K; the model folder comes from LMDOCK_MODELS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from lmdock import LLM, SamplingParams, UnsupportedError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def stories() -> Path:
    root = os.environ.get("LMDOCK_MODELS")
    path = Path(root or "", "stories260K")
    if not root or not (path / "config.json").is_file():
        pytest.fail("set LMDOCK_MODELS to the folder that holds stories260K")
    return path


def _copy_with_rope(src: Path, dst: Path, theta: float) -> Path:
    """stories260K whose config has only transformers 5's rope_parameters (no top-level rope_theta)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_rope_parameters_reach_mlx_lm(stories: Path, tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load

    model_dir = _copy_with_rope(stories, tmp_path / "m", 500000.0)
    ids = [1, 403, 407, 261, 378]
    with LLM(str(model_dir), backend="mlx") as llm:
        ours = llm.next_token_logprobs_sync(ids)
    right, _ = load(str(model_dir), model_config={"rope_theta": 500000.0})
    silent, _ = load(str(model_dir))  # what mlx-lm alone does: its default base
    def lsm(m):  # type: ignore[no-untyped-def]
        x = np.array(m(mx.array([ids]))[0, -1].astype(mx.float32), dtype=np.float64)
        return x - np.log(np.exp(x - x.max()).sum()) - x.max()
    np.testing.assert_allclose(ours, lsm(right), atol=1e-4)
    assert np.abs(ours - lsm(silent)).max() > 1e-3  # the difference the engine avoids


def test_unsupported_quantization_is_refused_by_name(stories: Path) -> None:
    with pytest.raises(UnsupportedError, match="quantization 'awq': MLX quantizes weights to 4 or 8 bits"):
        LLM(str(stories), backend="mlx", quantization={"algo": "awq"})


def test_q8_keeps_the_greedy_reference(stories: Path) -> None:
    with LLM(str(stories), backend="mlx", quantization={"algo": "int8_weight_only"}) as llm:
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_new_tokens=40))[0].outputs[0]
    assert out.text.startswith(", there was a little girl named Lily.")


def test_entry_module_imports_no_mlx() -> None:
    code = "import sys, lmdock_mlx; print([m for m in ('mlx', 'mlx_lm', 'numpy', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("shutdown", ["llm.shutdown()", "pass"])
def test_process_exits_cleanly(stories: Path, shutdown: str) -> None:
    """MLX streams made in the engine thread must go with it, or the process aborts at exit."""
    code = (
        "from lmdock import LLM, SamplingParams\n"
        f"llm = LLM({str(stories)!r}, backend='mlx')\n"
        "print(llm.generate('Once', SamplingParams(temperature=0, max_new_tokens=3))[0].outputs[0].text)\n"
        f"{shutdown}\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "terminate called" not in out.stderr


def test_decode_group_survives_joins_and_leaves(stories: Path) -> None:
    """Requests of different lengths arriving at different times: the persistent decode group gains
    and loses rows while others keep decoding, and every result equals the request run alone."""
    import time

    prompts = ["Once upon a time", "The cat", "Lily and Tom", "One day", "The sun was", "A little dog"]
    lengths = [60, 5, 22, 12, 40, 3]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    with LLM(str(stories), backend="mlx") as llm:
        alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        engine = llm.engine.engine  # the step engine under lmdock's loop
        sizes: list[int] = []
        forward_group = engine._forward_group  # every group forward, run ahead or not
        engine._forward_group = lambda ids: (sizes.append(len(engine.group_ids)), forward_group(ids))[1]
        futures = [llm.generate_async(p, sp) for p, sp in zip(prompts[:2], params[:2])]
        futures[1].result(timeout=60)  # a row leaves while the first request is still decoding
        futures += [llm.generate_async(p, sp) for p, sp in zip(prompts[2:], params[2:])]  # rows join
        together = [f.result(timeout=60).outputs[0].token_ids for f in futures]
        llm.clear_cache()  # the prefix caches hold KV state on purpose
        deadline = time.monotonic() + 5
        while (engine.group_ids or engine.caches) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.group_ids == [] and engine.caches == {}  # every row and cache released
    assert together == alone
    assert max(sizes) >= 4 and len(set(sizes)) >= 3  # the group grew and shrank while decoding


def _engine(stories: Path):  # type: ignore[no-untyped-def]
    """The step engine itself, driven from this thread (MLX streams belong to the thread using them)."""
    from lmdock import ModelConfig
    from lmdock_mlx._engine import MlxStepEngine

    return MlxStepEngine.load(ModelConfig(model=str(stories)), None, None, {"max_seq_len": 256})


def _decode(engine, prompts: list[list[int]], feed, n: int, ahead: bool) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Prefill ``prompts`` as sequences 0..k-1, then ``n`` decode steps of the whole group; ``feed``
    picks each row's next token from its logits row and the step number."""
    from lmdock.backend import SeqChunk

    tokens = [list(p) for p in prompts]
    last = engine.step([SeqChunk(s, p, 0, argmax_next=ahead) for s, p in enumerate(prompts)]).last
    for t in range(n):
        for s in range(len(tokens)):
            tokens[s].append(feed(last[s], t, s))
        last = engine.step([SeqChunk(s, [tokens[s][-1]], len(tokens[s]) - 1, argmax_next=ahead) for s in range(len(tokens))]).last
    return tokens


PROMPTS = [[1, 403, 407, 261], [1, 378, 317], [1, 430, 261, 5, 7], [1, 90]]


@pytest.mark.parametrize("rows", [4, 1], ids=["decode group", "one sequence"])
def test_run_ahead_keeps_the_greedy_tokens(stories: Path, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With argmax_next the next forward is queued from the device's argmax; the tokens are those of
    the same engine without it, and every step takes the step run ahead (nothing is undone)."""
    from lmdock_mlx import _engine as mod

    greedy = lambda row, t, s: int(np.argmax(row))  # noqa: E731
    plain = _decode(_engine(stories), PROMPTS[:rows], greedy, 24, ahead=False)
    engine = _engine(stories)
    undone: list[int] = []
    undo = mod._Ahead.undo
    monkeypatch.setattr(mod._Ahead, "undo", lambda self: (undone.append(1), undo(self))[1])
    forwards: list[int] = []
    forward_group = engine._forward_group
    engine._forward_group = lambda ids: (forwards.append(1), forward_group(ids))[1]
    ahead = _decode(engine, PROMPTS[:rows], greedy, 24, ahead=True)
    assert ahead == plain
    assert engine.ahead is not None and engine.ahead.seq_ids == list(range(rows))  # the step after the last
    assert undone == []
    if rows > 1:
        assert len(forwards) == 25  # each of the 24 steps computed once, and the one queued after the last


@pytest.mark.parametrize("rows", [4, 1], ids=["decode group", "one sequence"])
def test_run_ahead_undone_when_the_token_differs(stories: Path, rows: int) -> None:
    """A row fed something other than the argmax (what a sampler might pick): the position run ahead
    is trimmed and the step recomputed, so the logits equal an engine that never ran ahead."""
    from lmdock.backend import SeqChunk

    def feed(row, t, s):  # type: ignore[no-untyped-def]
        top = np.argsort(row)[::-1]
        return int(top[1] if (t + s) % 3 == 0 else top[0])  # the runner-up now and then

    plain_engine, ahead_engine = _engine(stories), _engine(stories)
    plain = _decode(plain_engine, PROMPTS[:rows], feed, 20, ahead=False)
    ahead = _decode(ahead_engine, PROMPTS[:rows], feed, 20, ahead=True)
    assert ahead == plain
    # the KV state agrees too: one more step from both (and, in the group, a row that leaves it)
    nxt = [SeqChunk(s, [7], len(plain[s]), argmax_next=True) for s in range(max(1, rows - 1))]
    np.testing.assert_allclose(ahead_engine.step(nxt).last, plain_engine.step(nxt).last, atol=1e-5)


def test_run_ahead_survives_a_row_leaving(stories: Path) -> None:
    """A sequence released while its step run ahead is queued: the other rows keep theirs."""
    from lmdock.backend import SeqChunk

    greedy = lambda row, t, s: int(np.argmax(row))  # noqa: E731
    plain_engine, engine = _engine(stories), _engine(stories)
    want = _decode(plain_engine, PROMPTS, greedy, 12, ahead=False)
    got = _decode(engine, PROMPTS, greedy, 6, ahead=True)
    engine.release(1)
    assert engine.group_ids == [0, 2, 3] and engine.ahead is not None and engine.ahead.seq_ids == [0, 2, 3]
    rows = [0, 2, 3]
    last = None
    for _ in range(6):
        if last is not None:
            for r, s in enumerate(rows):
                got[s].append(int(np.argmax(last[r])))
        last = engine.step([SeqChunk(s, [got[s][-1]], len(got[s]) - 1, argmax_next=True) for s in rows]).last
    for r, s in enumerate(rows):
        got[s].append(int(np.argmax(last[r])))
    assert [got[s] for s in rows] == [want[s][: len(got[s])] for s in rows]
    engine.release(0), engine.release(2), engine.release(3)
    assert engine.num_sequences() == 0 and engine.ahead is None


def test_sampled_rows_do_not_run_ahead(stories: Path) -> None:
    """A sampled request in the batch (argmax_next false for its row): no forward is queued ahead,
    and seeded results equal those of each request alone."""
    with LLM(str(stories), backend="mlx") as llm:
        engine = llm.engine.engine
        params = [SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0.9, seed=7, max_new_tokens=16, ignore_eos=True)]
        alone = [llm.generate("Once upon a time", p)[0].outputs[0].token_ids for p in params]
        queued: list[bool] = []
        step = engine.step

        def watched(chunks):  # type: ignore[no-untyped-def]
            out = step(chunks)
            queued.append(engine.ahead is not None)
            return out

        engine.step = watched
        both = [o.outputs[0].token_ids for o in llm.generate(["Once upon a time"] * 2, params)]
    assert both == alone
    assert queued and not any(queued)


@pytest.mark.parametrize("seed", range(6))
def test_run_ahead_equals_never_running_ahead_under_a_random_schedule(stories: Path, seed: int) -> None:
    """Two engines get the same random schedule (new prompts, chunked prefill, decodes, skipped
    steps, releases, forks, restarts without a release, prompt-logits chunks, a token other than
    the argmax now and then); one never sees argmax_next. Every step's logits must agree."""
    import random

    from lmdock.backend import SeqChunk

    rng = random.Random(seed)
    ref, ahead = _engine(stories), _engine(stories)
    tokens: dict[int, list[int]] = {}  # each sequence's tokens, the next one to feed included
    done: dict[int, int] = {}  # positions computed
    next_id = ran_ahead = 0
    for _ in range(60):
        if tokens and rng.random() < 0.1:
            s = rng.choice(list(tokens))
            ref.release(s), ahead.release(s)
            del tokens[s], done[s]
        elif rng.random() < 0.1 and (src := [s for s in tokens if done[s] > 1]):
            s = rng.choice(src)
            length = rng.randint(1, done[s])
            assert ref.fork(s, next_id, length) == ahead.fork(s, next_id, length)
            tokens[next_id], done[next_id] = tokens[s][:length] + [rng.randrange(3, 500)], length
            next_id += 1
        if rng.random() < 0.25 or not tokens:
            tokens[next_id], done[next_id] = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 8))], 0
            next_id += 1
        plan = []
        for s in tokens:
            if done[s] > 0 and rng.random() < 0.1:
                continue  # not scheduled this step
            if done[s] > 0 and rng.random() < 0.03:
                done[s] = 0  # recomputed from the start
            left = len(tokens[s]) - done[s]
            plan.append((s, left if rng.random() < 0.7 else rng.randint(1, left), rng.random() < 0.05))
        rng.shuffle(plan)
        out = {}
        for engine, hint in ((ref, False), (ahead, True)):
            chunks = [SeqChunk(s, tokens[s][done[s] : done[s] + n], done[s], full, hint and done[s] + n == len(tokens[s])) for s, n, full in plan]
            out[hint] = engine.step(chunks)
        ran_ahead += ahead.ahead is not None
        np.testing.assert_allclose(out[True].last, out[False].last, atol=1e-4)
        for s, full in out[False].full.items():
            np.testing.assert_allclose(out[True].full[s], full, atol=1e-4)
        for i, (s, n, _) in enumerate(plan):
            done[s] += n
            if done[s] == len(tokens[s]):
                top = np.argsort(out[False].last[i])[::-1]
                tokens[s].append(int(top[0] if rng.random() < 0.85 else top[1]))
        assert ref.num_sequences() == ahead.num_sequences()
    assert ran_ahead > 5  # the schedule did exercise running ahead
