from __future__ import annotations

import json
from pathlib import Path

import pytest
from lmdock import ConfigError, config_schema, find_config, load_config


def write(tmp: Path, text: str, name: str = "lmdock.toml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def test_full_entry_loads_with_env_substitution(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (isolated / "models" / "tiny").mkdir(parents=True)
    monkeypatch.setenv("MY_MODELS", str(isolated / "models"))
    path = write(isolated, """
default_model = "tiny"
[models.tiny]
model = "${env.MY_MODELS}/tiny"
backend = "onnx"
fallback = ["hf"]
[models.tiny.quantization]
algo = "int8_weight_only"
[models.tiny.build]
max_batch_size = 32
max_seq_len = 512
[models.tiny.scheduler]
max_num_seqs = 8
[models.tiny.sampling]
temperature = 0.8
[models.tiny.backends.onnx]
intra_op_threads = 2
""")
    cfg = load_config(path)
    mc = cfg.model("tiny")
    assert mc.model == str((isolated / "models" / "tiny").resolve())
    assert (mc.backend, mc.fallback) == ("onnx", ("hf",))
    assert mc.quantization.algo == "int8_weight_only"
    assert (mc.build.max_batch_size, mc.build.max_seq_len, mc.scheduler.max_num_seqs) == (32, 512, 8)
    assert mc.sampling == {"temperature": 0.8}
    assert mc.backend_options("onnx") == {"intra_op_threads": 2}


def test_default_value_and_relative_paths_resolve_against_the_file(isolated: Path) -> None:
    (isolated / "conf" / "m").mkdir(parents=True)
    path = write(isolated / "conf", '[models.a]\nmodel = "${env.LMDOCK_NOT_SET_X:-.}/m"\n')
    assert load_config(path).model("a").model == str((isolated / "conf" / "m").resolve())


def test_hub_ids_are_kept(isolated: Path) -> None:
    path = write(isolated, '[models.a]\nmodel = "karpathy/stories260K"\n')
    assert load_config(path).model("a").model == "karpathy/stories260K"


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ('[models.a]\nmodel = "x"\ntemprature = 1\n', "models.a.temprature", "unknown key 'temprature'"),
        ('[models.a]\nmodel = "x"\n[models.a.build]\nmax_seq_len = "long"\n', "models.a.build.max_seq_len", "expected int"),
        ('[models.a]\nmodel = "x"\n[models.a.sampling]\ntop_p = 3.0\n', "models.a.sampling.top_p", "must be in"),
        ('[models.a]\nmodel = "./nowhere"\n', "models.a.model", "does not exist"),
        ('[models.a]\nmodel = "${env.LMDOCK_SURELY_UNSET}/m"\n', "models.a.model", "LMDOCK_SURELY_UNSET is not set"),
        ('[models.a]\nbackend = "hf"\n', "models.a.model", "missing required key 'model'"),
        ('[models.a]\nmodel = "x"\nfallback = "hf"\n', "models.a.fallback", "expected list"),
        ('[model.a]\nmodel = "x"\n', "model", "unknown key 'model'"),
        ('[models.a]\nmodel = "x"\n[models.a.quantization]\nalgo = "int3"\n', "models.a.quantization.algo", "not allowed"),
        ('[models.a]\nmodel = "x"\ntool_parser = "hermez"\n', "models.a.tool_parser", "did you mean 'hermes'"),
        ('[models.a]\nmodel = "x"\nreasoning_parser = "deepseek"\n', "models.a.reasoning_parser", "known: think"),
    ],
)
def test_mistakes_name_file_and_key_path(isolated: Path, text: str, key: str, message: str) -> None:
    path = write(isolated, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert info.value.key == key
    assert str(info.value).startswith(f"{path}: {key}: ")


def test_parsers_are_named_per_model(isolated: Path) -> None:
    path = write(isolated, '[models.a]\nmodel = "x"\ntool_parser = "hermes"\nreasoning_parser = "think"\n')
    entry = load_config(path).model("a")
    assert (entry.tool_parser, entry.reasoning_parser) == ("hermes", "think")


def test_invalid_toml_names_the_file(isolated: Path) -> None:
    path = write(isolated, "[models.a\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_config(path)
    assert info.value.source == str(path)


def test_discovery_order(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_config() is None
    user = isolated / "xdg" / "lmdock" / "lmdock.toml"
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert find_config() == user
    local = write(isolated, "")
    assert find_config() == Path("lmdock.toml")
    env = write(isolated, "", "env.toml")
    monkeypatch.setenv("LMDOCK_CONFIG", str(env))
    assert find_config() == env
    explicit = write(isolated, "", "explicit.toml")
    assert find_config(explicit) == explicit
    with pytest.raises(ConfigError, match="not found"):
        find_config(isolated / "missing.toml")
    del local


def test_schema_validates_the_repository_example() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import tomllib

    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    example = Path(__file__).parents[2] / "lmdock.toml"
    jsonschema.validate(tomllib.loads(example.read_text()), schema)
    bad = {"models": {"a": {"model": "x", "temprature": 1}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    json.dumps(schema)


def test_read_model_json(tmp_path: Path) -> None:
    from lmdock.backend import read_model_json

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    (tmp_path / "broken.json").write_text("{nope")
    assert read_model_json(str(tmp_path), "generation_config.json") == {"temperature": 0.6}
    assert read_model_json(str(tmp_path), "broken.json") == {}
    assert read_model_json(str(tmp_path), "absent.json") == {}
