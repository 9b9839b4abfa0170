"""lmdock-onnx on the real stories260K; the model folders come from LMDOCK_MODELS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from lmdock import LLM, BackendError, SamplingParams, UnsupportedError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REFERENCE = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


def _model(name: str) -> Path:
    root = os.environ.get("LMDOCK_MODELS")
    path = Path(root or "", name)
    if not root or not (path / "config.json").is_file():
        pytest.fail(f"set LMDOCK_MODELS to the folder that holds {name}")
    return path


@pytest.fixture(scope="module")
def stories() -> Path:
    return _model("stories260K")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One export cache for the module (each test may still use its own through options)."""
    root = tmp_path_factory.getbasetemp() / "lmdock-cache"
    monkeypatch.setenv("LMDOCK_CACHE_DIR", str(root))
    return root / "onnx"


def _greedy(llm: LLM, prompt: str = "Once upon a time", n: int = 40) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_new_tokens=n))[0].outputs[0].text


def test_second_load_reuses_the_cached_export(stories: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    options = {"cache_dir": str(tmp_path / "exports")}
    with LLM(str(stories), backend="onnx", backends={"onnx": options}) as llm:
        assert _greedy(llm) == REFERENCE
        folder = llm.engine.engine.folder
    err = capfd.readouterr().err
    assert "exporting" in err and f"cached at {folder}" in err
    assert folder.parent == tmp_path / "exports"
    meta = json.loads((folder / "lmdock_onnx.json").read_text())
    assert meta["precision"] == "float32" and meta["opset"] == 17
    stamp = (folder / "model.onnx").stat().st_mtime_ns

    from lmdock_onnx import _export

    def no_export(*args: object, **kwargs: object) -> None:
        raise AssertionError("the second load exported again")

    monkeypatch.setattr(_export, "export", no_export)
    with LLM(str(stories), backend="onnx", backends={"onnx": options}) as llm:
        assert llm.engine.engine.folder == folder
        assert _greedy(llm) == REFERENCE
    assert "exporting" not in capfd.readouterr().err
    assert (folder / "model.onnx").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "exports").iterdir()] == [folder.name]  # no partial folders left


def test_export_key_follows_weights_opset_and_precision(stories: Path, tmp_path: Path) -> None:
    from lmdock_onnx import __version__
    from lmdock_onnx._cache import export_key

    copy = tmp_path / "stories260K"
    shutil.copytree(stories, copy)
    key = export_key(copy, opset=17, precision="float32", plugin_version=__version__)
    assert key == export_key(stories, opset=17, precision="float32", plugin_version=__version__)  # bytes, not paths
    assert key != export_key(copy, opset=18, precision="float32", plugin_version=__version__)
    assert key != export_key(copy, opset=17, precision="float32-int8_dynamic", plugin_version=__version__)
    assert key != export_key(copy, opset=17, precision="float32", plugin_version="9.9.9")
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert key != export_key(copy, opset=17, precision="float32", plugin_version=__version__)


def test_loads_an_exported_folder_as_it_is(stories: Path, tmp_path: Path) -> None:
    with LLM(str(stories), backend="onnx") as llm:
        exported = llm.engine.engine.folder
    folder = tmp_path / "my-export"
    shutil.copytree(exported, folder)
    (folder / "lmdock_onnx.json").unlink()  # as a folder made elsewhere: the layout is probed
    with LLM(str(folder), backend="onnx", backends={"onnx": {"cache_dir": str(tmp_path / "none")}}) as llm:
        assert llm.engine.engine.folder == folder
        assert llm.engine.engine.layout.present == "new"
        assert _greedy(llm) == REFERENCE
    assert not (tmp_path / "none").exists()  # nothing exported


def test_loads_onnxruntime_genai_model_builder_output(tmp_path: Path) -> None:
    """A folder from onnxruntime-genai's model builder (fp32, CPU: GroupQueryAttention, no
    position_ids, new KV at each row's own length) runs as it is, batched at different positions.
    stories260K-hd32 is stories260K rewritten with head size 32, which GroupQueryAttention needs."""
    source = _model("stories260K-hd32")
    out = tmp_path / "genai"
    build = subprocess.run(
        [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-m", str(source), "-o", str(out), "-p", "fp32", "-e", "cpu"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,  # the builder writes ./cache_dir
    )
    assert build.returncode == 0, build.stderr[-2000:]
    assert (out / "genai_config.json").is_file()
    prompts = ["Once upon a time", "The cat", "Lily and Tom"]
    params = SamplingParams(temperature=0, max_new_tokens=24)
    with LLM(str(source), backend="onnx") as ours:
        expected = [o.outputs[0].text for o in ours.generate(prompts, params)]
    with LLM(str(out), backend="onnx") as llm:
        layout = llm.engine.engine.layout
        assert (layout.present, layout.position_ids) == ("row", False)
        assert _greedy(llm) == REFERENCE
        assert [o.outputs[0].text for o in llm.generate(prompts, params)] == expected


def test_rows_at_different_positions_decode_together(stories: Path) -> None:
    """Requests of different lengths that join and leave mid-decode equal their one-by-one results,
    and decode steps really ran several rows in one session call."""
    prompts = ["Once upon a time", "The cat", "Lily and Tom went to", "One day", "The sun was", "A little dog"]
    lengths = [50, 5, 22, 12, 35, 3]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    with LLM(str(stories), backend="onnx") as llm:
        alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
        engine = llm.engine.engine
        widths: list[int] = []
        run = engine._run
        engine._run = lambda chunks: (widths.append(len(chunks)), run(chunks))[1]
        futures = [llm.generate_async(p, sp) for p, sp in zip(prompts[:2], params[:2])]
        futures[1].result(timeout=60)
        futures += [llm.generate_async(p, sp) for p, sp in zip(prompts[2:], params[2:])]
        together = [f.result(timeout=60).outputs[0].token_ids for f in futures]
        llm.clear_cache()  # the prefix caches hold KV state on purpose
        deadline = time.monotonic() + 5
        while engine.cache.seq_at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.cache.seq_at == []  # every slot released
    assert together == alone
    assert max(widths) >= 4


def test_kv_buffers_are_written_in_place(stories: Path) -> None:
    """Decode steps write into the preallocated buffers; they are reallocated only to grow."""
    from lmdock.backend import SeqChunk

    with LLM(str(stories), backend="onnx") as llm:
        engine = llm.engine.engine  # driven directly: lmdock's loop is idle without requests
        engine.step([SeqChunk(0, [1, 403, 407], 0), SeqChunk(1, [1, 378], 0)])
        buffers = [id(b) for b in engine.cache.k]
        tokens = {0: 3, 1: 2}
        for _ in range(20):
            out = engine.step([SeqChunk(s, [7], tokens[s]) for s in (0, 1)])
            for s in tokens:
                tokens[s] += 1
        assert [id(b) for b in engine.cache.k] == buffers
        assert out.last.shape == (2, 512)
        assert np.abs(engine.cache.k[0][0, :, : tokens[0]]).min(axis=(0, 2)).max() > 0  # every position written


def test_options_reach_the_session(stories: Path) -> None:
    options = {"intra_op_num_threads": 1, "graph_optimization_level": "basic", "session_config": {"session.intra_op.allow_spinning": "0"}}
    with LLM(str(stories), backend="onnx", backends={"onnx": options}) as llm:
        so = llm.engine.engine.session.get_session_options()
        assert so.intra_op_num_threads == 1
        assert str(so.graph_optimization_level).endswith("ORT_ENABLE_BASIC")
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert _greedy(llm, n=10) == REFERENCE[: len(_greedy(llm, n=10))]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": {"algo": "awq"}}, "quantization 'awq': lmdock-onnx quantizes through onnxruntime.quantization"),
        ({"quantization": {"algo": "int8_dynamic", "group_size": 64}}, "int8_dynamic quantizes per tensor"),
        ({"build": {"dtype": "bfloat16"}}, "build.dtype 'bfloat16'"),
        ({"backends": {"onnx": {"providers": ["NoSuchExecutionProvider"]}}}, "not in this onnxruntime build"),
    ],
)
def test_bad_settings_are_refused_by_name(stories: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(UnsupportedError, match=message):
        LLM(str(stories), backend="onnx", **kwargs)


def test_quantizing_an_exported_folder_is_refused(stories: Path) -> None:
    with LLM(str(stories), backend="onnx") as llm:
        folder = llm.engine.engine.folder
    with pytest.raises(UnsupportedError, match="already an ONNX model"):
        LLM(str(folder), backend="onnx", quantization={"algo": "int8_dynamic"})


def test_int8_dynamic_is_really_quantized(stories: Path) -> None:
    import onnx

    with LLM(str(stories), backend="onnx", quantization={"algo": "int8_dynamic"}) as llm:
        folder = llm.engine.engine.folder
        assert _greedy(llm) == REFERENCE
    ops = {n.op_type for n in onnx.load(str(folder / "model.onnx")).graph.node}
    assert ops & {"MatMulInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLinear"}
    assert "int8_dynamic" in json.loads((folder / "lmdock_onnx.json").read_text())["precision"]


def test_a_foreign_graph_is_refused_with_the_convention(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "model.onnx"))
    with pytest.raises(BackendError, match="does not follow lmdock-onnx's convention"):
        LLM(str(tmp_path), backend="onnx")


def test_export_without_torch_says_what_to_install(stories: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmdock_onnx import _load

    monkeypatch.setattr(_load, "_importable", lambda module: module != "torch")
    with pytest.raises(UnsupportedError, match=r"needs torch: pip install .*lmdock-onnx\[export\]"):
        LLM(str(stories), backend="onnx", backends={"onnx": {"cache_dir": str(tmp_path)}})


def test_entry_module_imports_no_engine() -> None:
    code = "import sys, lmdock_onnx; print([m for m in ('onnxruntime', 'onnx', 'numpy', 'torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
