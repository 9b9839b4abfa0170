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
        decode_group = engine._decode_group
        engine._decode_group = lambda tokens: (sizes.append(len(engine.group_ids)), decode_group(tokens))[1]
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
