"""The core's pooling batcher: embedding and scoring requests from many callers, computed together.

1. ``submit`` queues one tokenized prompt with a future and returns at once (any thread).
2. The worker thread takes everything queued, groups it by pooling type, sorts each group by length
   (so a batch pads little, as sentence-transformers' ``encode`` sorts) and cuts it into batches of at
   most ``max_num_seqs`` prompts and ``max_num_batched_tokens`` padded tokens.
3. One ``engine.embed`` per batch; each row goes to its future.  A batch that fails is retried one
   prompt at a time, so a bad prompt fails alone.

Also here: reading a model's sentence-transformers pooling files (``read_pooling_config``), and their
pooling in NumPy for engines that return hidden states (``pool_hidden``).
"""

from __future__ import annotations

import json
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdock._engine.request_engine import RequestEngineBase
from lmdock._plugin.contract import PoolingEngine, PoolingInput
from lmdock._plugin.errors import BackendError, EngineClosedError, UnsupportedError
from lmdock._plugin.model_files import read_model_json

#: sentence-transformers' ``1_Pooling/config.json`` modes lmdock pools with.
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


#: Architectures that generate text: a step engine's, not a pooling engine's.
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def read_pooling_config(model: str | Path) -> dict[str, Any]:
    """What a model is for and how sentence-transformers would pool it, from its files:

    * ``task``: "classify" (a ``*ForSequenceClassification``: a cross-encoder), "embed" (an encoder:
      a sentence-transformers folder or a base ``*Model``), or None (a generative model);
    * ``pooling_type`` ("CLS", "MEAN", "LAST") and ``normalize`` (a ``Normalize`` module follows),
      from ``modules.json`` and ``1_Pooling/config.json``; without them MEAN and no normalization,
      sentence-transformers' own default for a plain transformers folder;
    * ``max_seq_len``: ``sentence_bert_config.json``'s ``max_seq_length``, or None.

    config.json is read from a folder or the hub cache; the sentence-transformers files from a folder.
    """
    folder = Path(model)
    archs = read_model_json(str(model), "config.json").get("architectures") or []
    modules_file = folder / "modules.json"
    task = None
    if any(a.endswith("ForSequenceClassification") for a in archs):
        task = "classify"
    elif modules_file.is_file() or (archs and not any(a.endswith(_GENERATIVE) for a in archs) and any(a.endswith("Model") for a in archs)):
        task = "embed"
    result: dict[str, Any] = {"task": task, "pooling_type": "MEAN", "normalize": False,
                              "max_seq_len": read_model_json(str(model), "sentence_bert_config.json").get("max_seq_length")}
    if not modules_file.is_file():
        return result
    for module in json.loads(modules_file.read_text()):
        kind = module.get("type", "")
        if kind.endswith(".Normalize"):
            result["normalize"] = True
        elif kind.endswith(".Pooling"):
            result["pooling_type"] = _st_pooling_mode(folder / module.get("path", ""))
        elif not kind.endswith(".Transformer"):
            raise UnsupportedError(f"{modules_file}: module {kind!r} is not one lmdock applies (Transformer, Pooling, Normalize)")
    return result


def _st_pooling_mode(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    on = [key for key, value in cfg.items() if key.startswith("pooling_mode") and value]
    modes = [_ST_MODES[key] for key in on if key in _ST_MODES]
    if len(on) != 1 or len(modes) != 1:
        raise UnsupportedError(f"{folder / 'config.json'}: pooling {', '.join(on) or 'none'}; lmdock pools with exactly one of "
                               f"{', '.join(_ST_MODES)}")
    return modes[0]


@dataclass
class _Job:
    item: PoolingInput
    pooling_type: str
    future: Future[Any]


class PoolingRunner(RequestEngineBase):
    """Wraps a :class:`PoolingEngine` for the ``LLM`` facade: batches requests on one worker thread.
    The facade's engine, whose kind says it pools (``LLM.embed``, ``LLM.score``) rather than generates."""

    kind = "pooling"

    def __init__(self, engine: PoolingEngine, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.task = engine.task
        self.pooling_type = engine.pooling_type
        self.normalize = engine.normalize
        self.hidden_size = engine.hidden_size
        self.generation_config: dict[str, Any] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, engine.max_seq_len)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="lmdock-pooling", daemon=True)
        self._thread.start()

    # -- the facade's side ----------------------------------------------------------------------

    def pool(self, item: PoolingInput, pooling_type: str) -> Future[Any]:
        """Queue one prompt; the future gets its row (a float32 NumPy vector)."""
        if self._closed:
            raise EngineClosedError("this engine was shut down; create a new LLM")
        future: Future[Any] = Future()
        self._queue.put(_Job(item, pooling_type, future))
        return future

    def submit(self, request: Any, sink: Any) -> None:
        raise UnsupportedError("this model is loaded for pooling (an embedding model or a cross-encoder): use "
                               "LLM.embed or LLM.score; generation needs a causal language model")

    def abort(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=60)
        self.engine.close()

    # -- the worker -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return self._drain()
            jobs = [job]
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._run(jobs)
                    return self._drain()
                jobs.append(nxt)
            self._run(jobs)

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.future.set_exception(EngineClosedError("the engine was shut down before this request ran"))

    def _run(self, jobs: list[_Job]) -> None:
        jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
        by_type: dict[str, list[_Job]] = {}
        for job in jobs:
            by_type.setdefault(job.pooling_type, []).append(job)
        for pooling_type, group in by_type.items():
            group.sort(key=lambda j: len(j.item.token_ids))
            for batch in self._batches(group):
                self._forward(batch, pooling_type)

    def _batches(self, group: list[_Job]) -> list[list[_Job]]:
        """Cut a length-sorted group so each batch's padded size stays within the token budget."""
        batches: list[list[_Job]] = [[]]
        for job in group:
            batch = batches[-1]
            padded = (len(batch) + 1) * len(job.item.token_ids)  # sorted: this job is the longest
            if batch and (len(batch) >= self.max_num_seqs or padded > self.max_num_batched_tokens):
                batches.append(batch := [])
            batch.append(job)
        return batches

    def _forward(self, batch: list[_Job], pooling_type: str) -> None:
        try:
            rows = self.engine.embed([j.item for j in batch], pooling_type)
        except Exception as exc:
            if len(batch) > 1:  # find the prompt that failed; the others still get their rows
                for job in batch:
                    self._forward([job], pooling_type)
                return
            batch[0].future.set_exception(BackendError(f"the engine failed on this prompt: {type(exc).__name__}: {exc}"))
            return
        for job, row in zip(batch, rows):
            job.future.set_result(row)


def pool_hidden(hidden: np.ndarray, mask: np.ndarray, pooling_type: str) -> np.ndarray:
    """sentence-transformers' ``Pooling`` in NumPy over ``hidden`` [batch, tokens, dim] with the
    attention ``mask`` [batch, tokens] (right padding): CLS, masked MEAN (sum / clamp(count, 1e-9)),
    or LAST."""
    if pooling_type == "CLS":
        return hidden[:, 0]
    if pooling_type == "LAST":
        return hidden[np.arange(hidden.shape[0]), mask.sum(axis=1) - 1]
    m = mask[:, :, None].astype(np.float32)
    return (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
