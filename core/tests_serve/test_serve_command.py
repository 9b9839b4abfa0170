"""``lmdock serve`` as vLLM's users type it: every route in its help, vLLM's path and flags, a served name."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from lmdock import ServerConfig
from lmdock.server import ServedModel, create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_serving import fake_llm  # noqa: E402
from fakes import FakeStepEngine  # noqa: E402


def test_serve_help_names_every_route(registry: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`lmdock serve --help` lists what the app serves (read from the app's own routes)."""
    from lmdock._cli.main import main

    llm = fake_llm(FakeStepEngine)
    try:
        app = create_app([ServedModel("stories", llm, 8)], ServerConfig())
        paths = set(app.openapi()["paths"])  # FastAPI's own list of the app's routes
    finally:
        llm.shutdown()
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert len(paths) >= 15 and "/v1/completions" in paths
    missing = sorted(p for p in paths if p.replace("{model_id}", "{id}") not in text)
    assert not missing, f"lmdock serve --help does not name {missing}"


def test_vllm_style_serve_path_with_vllms_flags(tmp_path: Path) -> None:
    """`lmdock serve PATH --served-model-name NAME --max-model-len N --dtype float32`, as `vllm serve` takes it."""
    from serve_helpers import DOCUMENTED, Server, models_dir

    s = Server(tmp_path, args=(str(models_dir()), "--backend", "hf", "--served-model-name", "tiny",
                               "--max-model-len", "128", "--dtype", "float32"))
    try:
        cards = httpx.get(f"{s.url}/v1/models").json()["data"]
        assert [(c["id"], c["max_model_len"], c["backend"]) for c in cards] == [("tiny", 128, "hf")]
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40,
                                                          "temperature": 0}, timeout=120)
        assert r.json()["choices"][0]["text"] == DOCUMENTED
    finally:
        s.stop()


def test_served_model_name_names_one_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmdock._cli.main import main

    (tmp_path / "lmdock.toml").write_text('[models.a]\nmodel = "x"\n[models.b]\nmodel = "y"\n', encoding="utf-8")
    code = main(["serve", "--config", str(tmp_path / "lmdock.toml"), "-m", "a", "-m", "b", "--served-model-name", "z"])
    assert code == 2 and "--served-model-name names one model; 2 are served" in capsys.readouterr().err
