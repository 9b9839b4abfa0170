"""PoolingParams, the ``[models.NAME.pooling]`` table, sentence-transformers' pooling files, and the
core's pooling batcher, driven by a fake pooling engine (core plumbing only: real models are tested by
lmdock-conformance's test_pooling.py on lmdock-hf and lmdock-onnx)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from lmdock import ConfigError, EngineClosedError, PoolingParams, load_config
from lmdock.backend import PoolingEngineBase, PoolingInput, read_pooling_config


def test_pooling_params_validate_and_layer() -> None:
    assert PoolingParams(pooling_type="cls").pooling_type == "CLS"
    for field, value in (("dimensions", 0), ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("pooling_type", "MAX")):
        with pytest.raises(ValueError, match=rf"^{field}: "):
            PoolingParams(**{field: value})
    call = PoolingParams(dimensions=64)
    merged = call.over(PoolingParams(normalize=True, dimensions=128, pooling_type="MEAN"))
    assert merged == PoolingParams(normalize=True, dimensions=64, pooling_type="MEAN")


def test_config_pooling_table_is_validated(isolated: Path) -> None:
    (isolated / "m").mkdir()
    path = isolated / "lmdock.toml"
    path.write_text('[models.e]\nmodel = "./m"\n[models.e.pooling]\npooling_type = "CLS"\nnormalize = false\n')
    assert load_config(path).model("e").pooling == PoolingParams(normalize=False, pooling_type="CLS")
    path.write_text('[models.e]\nmodel = "./m"\n[models.e.pooling]\nnormalise = true\n')
    with pytest.raises(ConfigError, match=r"models\.e\.pooling\.normalise"):
        load_config(path)


def _st_folder(tmp: Path, modes: dict[str, bool], normalize: bool) -> Path:
    (tmp / "1_Pooling").mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp / "modules.json").write_text(json.dumps(modules))
    return tmp


def test_read_pooling_config(tmp_path: Path) -> None:
    folder = _st_folder(tmp_path / "a", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, True)
    assert read_pooling_config(folder) == {"task": "embed", "pooling_type": "CLS", "normalize": True, "max_seq_len": 128}
    bad = _st_folder(tmp_path / "b", {"pooling_mode_max_tokens": True}, False)
    with pytest.raises(Exception, match="pooling_mode_max_tokens"):
        read_pooling_config(bad)
    causal = tmp_path / "c"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert read_pooling_config(causal)["task"] is None
    (causal / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    assert read_pooling_config(causal)["task"] == "classify"


class FakePoolingEngine(PoolingEngineBase):
    """A fake pooling engine for the batcher's plumbing: a prompt's row is [sum of its ids, its length];
    a prompt holding token 13 makes the whole batch raise."""

    tokenizer = None
    max_seq_len = 16
    task = "embed"
    pooling_type = "MEAN"
    normalize = False
    hidden_size = 2

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        #: set once a batch is in ``embed``: what the runner took off its queue is in that batch
        self.entered = threading.Event()
        self.closed = False

    def embed(self, batch: list[PoolingInput], pooling_type: str) -> list[list[float]]:
        self.entered.set()
        self.gate.wait(10)
        self.batches.append([len(item.token_ids) for item in batch])
        if any(13 in item.token_ids for item in batch):
            raise ValueError("token 13")
        return [[float(sum(item.token_ids)), float(len(item.token_ids))] for item in batch]

    def close(self) -> None:
        self.closed = True


def _runner(engine: FakePoolingEngine, seqs: int = 4, tokens: int = 16) -> Any:
    from lmdock._engine.pooling import PoolingRunner

    return PoolingRunner(engine, max_num_seqs=seqs, max_num_batched_tokens=tokens)


def test_queued_prompts_are_batched_by_length_within_the_budget() -> None:
    engine = FakePoolingEngine()
    runner = _runner(engine)
    engine.gate.clear()  # the first prompt's batch waits; the rest queue behind it
    first = runner.pool(PoolingInput([1]), "MEAN")
    # the first batch is formed once it is in embed (an empty queue alone is not enough: the runner
    # takes the first job, then the others already queued, before its batch starts)
    assert engine.entered.wait(10)
    lengths = [5, 1, 3, 8, 2, 2, 1, 4]
    futures = [runner.pool(PoolingInput([1] * n), "MEAN") for n in lengths]
    engine.gate.set()
    assert first.result(10) == [1.0, 1.0]
    assert [f.result(10) for f in futures] == [[float(n), float(n)] for n in lengths]
    later = engine.batches[1:]
    assert sorted(n for b in later for n in b) == sorted(lengths)
    for batch in later:
        assert len(batch) <= 4 and len(batch) * max(batch) <= 16
    assert len(later) < len(lengths)
    runner.close()
    assert engine.closed


def test_a_failing_prompt_fails_alone() -> None:
    engine = FakePoolingEngine()
    runner = _runner(engine)
    engine.gate.clear()
    runner.pool(PoolingInput([1]), "MEAN")
    futures = [runner.pool(PoolingInput(ids), "MEAN") for ids in ([2, 2], [13], [3])]
    engine.gate.set()
    assert futures[0].result(10) == [4.0, 2.0]
    with pytest.raises(Exception, match="token 13"):
        futures[1].result(10)
    assert futures[2].result(10) == [3.0, 1.0]
    runner.close()
    with pytest.raises(EngineClosedError):
        runner.pool(PoolingInput([1]), "MEAN")
