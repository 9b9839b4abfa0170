"""LoRA adapters declared in the config (``[models.NAME.adapters]``) served as ``NAME:ADAPTER`` by a real
``lmdock serve`` (stories260K on hf), with the official ``openai`` client: listed in ``/v1/models`` with
their parent, run under the adapter (the same tokens as ``LLM.generate`` with that adapter in this
process), the base model beside them unchanged, an unknown adapter a 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from serve_helpers import DOCUMENTED, Server, models_dir

PROMPT = "Once upon a time"


def _adapter(folder: Path, seed: int) -> Path:
    """A PEFT-format adapter with random weights (a fixed seed) on stories260K's q/v projections."""
    import json

    from safetensors import safe_open
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    with safe_open(str(models_dir() / "model.safetensors"), "np") as f:
        for key in [k for k in f.keys() if k.endswith(("q_proj.weight", "v_proj.weight"))]:  # noqa: SIM118
            out_f, in_f = f.get_slice(key).get_shape()
            module = key.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(0, in_f**-0.5, (4, in_f)).astype(np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = rng.normal(0, 0.5, (out_f, 4)).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return folder


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("lora")
    _adapter(tmp / "sql", 1)
    server = Server(tmp, extra_models='[models.stories.adapters]\nsql = "sql"\n')
    yield server
    server.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_adapters_are_listed_with_their_parent(lora_server: Server) -> None:
    models = {m.id: m for m in _client(lora_server).models.list().data}
    assert list(models) == ["stories", "stories:sql"]
    assert models["stories:sql"].model_extra["parent"] == "stories"
    assert models["stories:sql"].model_extra["root"].endswith("sql")


def test_a_request_for_model_adapter_runs_under_the_adapter(lora_server: Server) -> None:
    from lmdock import LLM, LoRARequest

    c = _client(lora_server)
    r = c.completions.create(model="stories:sql", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.model == "stories:sql"
    with LLM(str(models_dir()), backend="hf") as llm:
        want = llm.generate(PROMPT, {"temperature": 0, "max_tokens": 20},
                            lora_request=LoRARequest("sql", lora_server.config.parent / "sql"))[0].outputs[0].text
    assert r.choices[0].text == want
    assert not DOCUMENTED.startswith(want)  # the adapter changed the output
    base = c.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0)
    assert base.choices[0].text == DOCUMENTED and base.model == "stories"


def test_an_unknown_adapter_is_a_404_naming_the_served_ones(lora_server: Server) -> None:
    with pytest.raises(openai.NotFoundError, match=r"'stories:nope' is not served here; served models: stories, stories:sql"):
        _client(lora_server).completions.create(model="stories:nope", prompt=PROMPT, max_tokens=4)


def test_metrics_have_lora_requests_info(lora_server: Server) -> None:
    import httpx

    text = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("lmdock:lora_requests_info{"))
    assert 'model_name="stories"' in line and 'max_lora="8"' in line and 'running_lora_adapters=""' in line


@pytest.fixture(scope="module")
def runtime_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("lora-runtime")
    _adapter(tmp / "rt", 2)
    server = Server(tmp, server_table="allow_runtime_lora_updating = true\n")
    yield server
    server.stop()


def test_runtime_loading_is_off_unless_allowed(lora_server: Server) -> None:
    import httpx

    r = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(lora_server.config.parent / "sql")})
    assert r.status_code == 403 and "allow_runtime_lora_updating" in r.text


def test_load_and_unload_an_adapter_at_run_time(runtime_server: Server) -> None:
    """vLLM's routes: loaded, it is served as stories:rt (the same tokens as LLM.generate with it);
    unloaded, a request for it is a 404; loading a name twice is a 400."""
    import httpx
    from lmdock import LLM, LoRARequest

    url, folder = runtime_server.url, runtime_server.config.parent / "rt"
    c = _client(runtime_server)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(folder)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'rt' added successfully."
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(folder)}).status_code == 400
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}).status_code == 400
    assert [m.id for m in c.models.list().data] == ["stories", "stories:rt"]
    got = c.completions.create(model="stories:rt", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    with LLM(str(models_dir()), backend="hf") as llm:
        want = llm.generate(PROMPT, {"temperature": 0, "max_tokens": 20}, lora_request=LoRARequest("rt", folder))[0].outputs[0].text
    assert got == want and not DOCUMENTED.startswith(got)
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="stories:rt", prompt=PROMPT, max_tokens=4)
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt"}).status_code == 404
    assert c.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text == DOCUMENTED


def test_runtime_adapter_names_and_counts_are_bounded_and_lists_cut(runtime_server: Server) -> None:
    """A name is at most 64 characters; a model takes at most MAX_ADAPTERS; every 404 lists at most 20
    served names and says how many more (100 names of 900 KB made each 404, and /v1/models, 90.9 MB)."""
    import httpx
    from lmdock.server.serving_models import MAX_ADAPTERS

    url, folder = runtime_server.url, str(runtime_server.config.parent / "rt")
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "n" * 65, "lora_path": folder})
    assert r.status_code == 400 and "1 to 64" in r.json()["error"]["message"] and len(r.text) < 1000
    names = [f"a{i:03d}" for i in range(MAX_ADAPTERS)]
    for name in names:
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folder}).status_code == 200
    try:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "one-more", "lora_path": folder})
        assert r.status_code == 400 and f"serves {MAX_ADAPTERS} adapters" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "stories:nope", "prompt": PROMPT, "max_tokens": 1})
        message = r.json()["error"]["message"]
        assert r.status_code == 404 and f"and {MAX_ADAPTERS + 1 - 20} more" in message and message.count("stories:a") == 19
        assert len(httpx.get(f"{url}/v1/models").json()["data"]) == MAX_ADAPTERS + 1
    finally:
        for name in names:
            httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})


def test_a_runtime_adapter_is_checked_at_load_and_its_files_never_echoed(runtime_server: Server, tmp_path: Path) -> None:
    """/v1/load_lora_adapter reads the folder's config and header (off the event loop): a bad one is
    a 400 then, not at first use; a config symlinked to another file is refused without its content."""
    import httpx

    url = runtime_server.url
    bad = _adapter(tmp_path / "bad", 3)
    (bad / "adapter_config.json").unlink()
    (tmp_path / "secret.json").write_text('{"peft_type": "SECRET-VALUE", "r": "SECRET-VALUE"}')
    (bad / "adapter_config.json").symlink_to(tmp_path / "secret.json")
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "SECRET" not in r.text and "peft_type" in r.text, r.text
    (tmp_path / "secret.json").write_text('{"r": 4, "rank_pattern": {"(a+)+X": 2}}')
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "rank_pattern" in r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "x" * 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert httpx.get(f"{url}/health").status_code == 200
