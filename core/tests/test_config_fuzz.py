"""A fuzz of the config file: 10,000 generated documents, built from lmdock's own key names and
random ones, with values of every TOML type.  Loading one either works or raises a ConfigError that
names the file and (for a document that is valid TOML) the key path; never another exception."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lmdock import ConfigError, load_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

KEYS = [
    "models", "default_model", "model", "backend", "fallback", "tokenizer", "revision", "trust_remote_code",
    "sampling", "build", "scheduler", "kv_cache", "quantization", "offload", "backends", "hf", "dtype",
    "max_seq_len", "max_batch_size", "max_num_seqs", "max_waiting", "max_num_batched_tokens", "policy",
    "temperature", "top_p", "top_k", "min_p", "max_new_tokens", "seed", "stop", "n", "algo", "group_size",
    "max_tokens", "cpu_space_gib", "enable_prefix_caching", "num_threads", "logprobs", "beam_width",
]

scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["auto", "hf", "fcfs", "float32", "int8_weight_only", "${env.NOPE}", "${env.HOME:-x}", "./missing", "~/x", "stories"]),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
model_entry = st.dictionaries(st.sampled_from(KEYS), values, max_size=5).map(lambda d: {"model": "some/hub-id", **d} if len(d) % 2 else d)
documents = st.one_of(
    st.fixed_dictionaries({"models": st.dictionaries(st.text(min_size=1, max_size=6), model_entry, max_size=3)}, optional={"default_model": values}),
    st.dictionaries(keys, values, max_size=4),
)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_document(doc: dict[str, Any]) -> str:
    return "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in doc.items())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
@given(doc=documents)
def test_generated_config_documents(folder: Path, doc: dict[str, Any]) -> None:
    text = toml_document(doc)
    path = folder / "lmdock.toml"
    path.write_text(text, encoding="utf-8")
    try:
        tomllib.loads(text)
        valid_toml = True
    except tomllib.TOMLDecodeError:
        valid_toml = False
    try:
        load_config(path)
    except ConfigError as exc:
        assert exc.source == str(path), exc
        if valid_toml:
            assert exc.key, f"the error names no key path: {exc}\n{text}"


@settings(max_examples=500, deadline=None, database=None, derandomize=True)
@given(text=st.text(max_size=200))
def test_arbitrary_text_is_a_config_error_or_a_config(folder: Path, text: str) -> None:
    path = folder / "raw.toml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(path) in str(exc)
