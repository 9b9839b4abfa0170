"""vLLM's pooling runner as lmdock's pooling engine: embedding models and cross-encoders.

* An encoder (all-MiniLM-L6-v2, any ``BertModel`` vLLM loads) runs with ``runner="pooling"``; each
  prompt is one vLLM request with ``PoolingParams(task="token_embed", use_activation=False)``, which
  returns its last hidden states, and ``embed`` pools them (CLS, MEAN or LAST) as
  sentence-transformers' ``Pooling`` module does. Pooling here rather than with vLLM's sequence pooler
  keeps the pooling type a per-call choice (vLLM fixes it per engine).
* A sequence classifier with one label (a cross-encoder) returns its raw logits
  (``task="classify"``, ``use_activation=False``), the segment ids of a pair passed the way vLLM's
  own score API passes them; the core applies the sigmoid.

The core batches, tokenizes, normalizes and truncates dimensions (``lmdock.backend.PoolingEngine``);
the prompts of one ``embed`` call run in the same vLLM steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from lmdock import BackendError, ModelConfig, UnsupportedError
from lmdock.backend import PoolingEngineBase, PoolingInput, pool_hidden

from lmdock_vllm._build import check_torch_companions, engine_error, shutdown


class VllmPoolingEngine(PoolingEngineBase):
    """``lmdock.backend.PoolingEngine`` over vLLM's pooling runner (a synchronous ``LLMEngine``)."""

    def __init__(self, engine: Any, tokenizer: Any, task: str, max_seq_len: int, st: dict[str, Any], hidden_size: int) -> None:
        self._engine = engine
        self.tokenizer = tokenizer
        self.task = task
        self.max_seq_len = max_seq_len
        self.pooling_type = st["pooling_type"]
        self.normalize = st["normalize"] if task == "embed" else False
        self.hidden_size = hidden_size
        self._ids = itertools.count()

    @classmethod
    def load(cls, mc: ModelConfig, engine_kwargs: dict[str, Any], st: dict[str, Any]) -> VllmPoolingEngine:
        """``st``: ``lmdock.backend.read_pooling_config(mc.model)``."""
        check_torch_companions()
        from transformers import AutoTokenizer
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        kwargs = {k: v for k, v in engine_kwargs.items() if k not in _GENERATION_ONLY}
        kwargs.update(runner="pooling", enable_prefix_caching=False)
        try:
            args = EngineArgs(**kwargs)
        except TypeError as exc:  # an unknown engine_args key
            raise BackendError(f"vLLM refused the engine arguments of {mc.model!r}: {exc}") from None
        try:
            engine = LLMEngine.from_engine_args(args)
        except ValueError as exc:
            raise BackendError(f"vLLM could not load {mc.model!r} in its pooling runner: {exc}") from None
        except Exception as exc:  # anything else from the engine: lmdock's error, naming the model
            raise engine_error(exc, mc.model, "loading the pooling runner for") from exc
        task = st["task"]
        hf_config = engine.model_config.hf_config
        if task == "classify" and getattr(hf_config, "num_labels", 1) != 1:
            shutdown(engine)
            raise UnsupportedError(f"{mc.model!r} is a classifier with {hf_config.num_labels} labels; LLM.score needs a "
                                   "cross-encoder with one label")
        hidden = int(hf_config.hidden_size) if task == "embed" else 1
        tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model, trust_remote_code=mc.trust_remote_code, revision=mc.revision)
        limit = int(engine.model_config.max_model_len)
        max_seq_len = min(limit, st["max_seq_len"]) if st["max_seq_len"] else limit
        return cls(engine, tokenizer, task, max_seq_len, st, hidden)

    def embed(self, batch: Sequence[PoolingInput], pooling_type: str) -> np.ndarray:
        from vllm.pooling_params import PoolingParams

        engine = self._engine
        if engine is None:
            raise BackendError("this LLM was shut down; create a new one")
        task = "token_embed" if self.task == "embed" else "classify"
        order = [f"pool-{next(self._ids)}" for _ in batch]
        try:
            for rid, item in zip(order, batch):
                extra = _segments(item.token_type_ids) if self.task == "classify" else None
                params = PoolingParams(task=task, use_activation=False, extra_kwargs=extra)
                engine.add_request(rid, {"prompt_token_ids": list(item.token_ids)}, params)
            done: dict[str, Any] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs.data
        except Exception:
            engine.abort_request([rid for rid in order])  # nothing of this batch stays in vLLM
            raise
        rows = [_numpy(done[rid]) for rid in order]
        if self.task == "classify":
            return np.stack([r.reshape(-1) for r in rows]).astype(np.float32)
        return np.stack([pool_hidden(r[None], np.ones((1, len(r))), pooling_type)[0] for r in rows]).astype(np.float32)

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            shutdown(engine)


#: EngineArgs of the generate runner that mean nothing to the pooling runner.
_GENERATION_ONLY = frozenset({"logprobs_mode", "max_logprobs", "structured_outputs_config", "scheduling_policy"})


def _segments(types: Sequence[int] | None) -> dict[str, int] | None:
    """A pair's segment ids as vLLM's BERT takes them (its score API's convention): the position where
    the second segment starts, ``compressed_token_type_ids`` (vLLM ignores a prompt's token_type_ids)."""
    if not types or 1 not in types:
        return None
    start = list(types).index(1)
    if any(t != (1 if i >= start else 0) for i, t in enumerate(types)):
        raise UnsupportedError("vLLM's BERT takes one pair of segments (zeros then ones); these segment ids are not that")
    return {"compressed_token_type_ids": start}


def _numpy(data: Any) -> np.ndarray:
    return np.asarray(data.float().numpy() if hasattr(data, "numpy") else data, dtype=np.float32)
