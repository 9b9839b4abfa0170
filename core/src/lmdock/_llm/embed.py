"""Embeddings and scores (furiosa-llm's and vLLM's ``embed`` / ``score``) as the ``LLM`` serves them
over a pooling engine: the request side, which ``_engine/pooling.py``'s runner batches."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from lmdock._config.model import ModelConfig
from lmdock._config.pooling import PoolingParams
from lmdock._config.schema import build
from lmdock._llm.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from lmdock._llm.prompts import Prompt, indexed
from lmdock._plugin.contract import PoolingInput
from lmdock._plugin.errors import RequestError, UnsupportedError

#: Pooling parameters as a call takes them: complete params, a dict of fields, or None (the defaults).
PoolingArg = PoolingParams | dict[str, Any] | None

_ids = itertools.count()


class PoolingCalls:
    """``LLM.embed`` and ``LLM.score`` over one pooling engine: parameters merged with the model's and
    the config's defaults, texts tokenized (a batch in one tokenizer call), inputs checked against
    the model's length, rows pooled together and post-processed as vLLM does."""

    def __init__(self, engine: Any, tokenizer: Callable[[], Any], model_config: ModelConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer  # raises for a backend loaded without one, when a text needs it
        self.model_config = model_config

    def embed(self, batch: list[Prompt], pooling_params: PoolingArg | Sequence[PoolingArg]) -> list[EmbeddingRequestOutput]:
        if self.engine.task != "embed":
            raise UnsupportedError(f"model {self.model_config.model!r} is a cross-encoder (a sequence classifier): it scores "
                                   "text pairs with LLM.score; embed needs an embedding model")
        plist = list(pooling_params) if isinstance(pooling_params, (list, tuple)) else [pooling_params] * len(batch)
        if len(plist) != len(batch):
            raise RequestError(f"got {len(plist)} pooling_params for {len(batch)} prompts")
        params = [indexed(i, len(batch), self._pooling_params, p) for i, p in enumerate(plist)]
        encoded = self._encode_texts(batch, [prm.truncate_prompt_tokens for prm in params])
        items = [indexed(i, len(batch), self._pooling_input, p, None, prm.truncate_prompt_tokens, encoded.get(i))
                 for i, (p, prm) in enumerate(zip(batch, params))]
        rows = self._pool(items, [p.pooling_type for p in params])
        return [
            EmbeddingRequestOutput(f"embd-{next(_ids)}", EmbeddingOutput(_postprocess(row, prm)), item.token_ids)
            for row, prm, item in zip(rows, params, items)
        ]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate_prompt_tokens: int | None,
              pooling_params: PoolingArg) -> list[ScoringRequestOutput]:
        firsts, seconds = _pairs(text_1, text_2)
        params = self._pooling_params(pooling_params)
        if truncate_prompt_tokens is not None:
            params = params.replace(truncate_prompt_tokens=truncate_prompt_tokens)
        truncate = params.truncate_prompt_tokens
        n = len(firsts)
        if self.engine.task == "classify":
            items = [indexed(i, n, self._pooling_input, a, b, truncate) for i, (a, b) in enumerate(zip(firsts, seconds))]
            rows = self._pool(items, [params.pooling_type] * n)
            return [ScoringRequestOutput(f"score-{next(_ids)}", ScoringOutput(_sigmoid(row)), item.token_ids)
                    for row, item in zip(rows, items)]
        left = [indexed(i, n, self._pooling_input, a, None, truncate) for i, a in enumerate(firsts)]
        right = [indexed(i, n, self._pooling_input, b, None, truncate) for i, b in enumerate(seconds)]
        rows = self._pool(left + right, [params.pooling_type] * (2 * n))
        return [
            ScoringRequestOutput(f"score-{next(_ids)}", ScoringOutput(_cosine(rows[i], rows[n + i], params)), left[i].token_ids + right[i].token_ids)
            for i in range(n)
        ]

    def _pooling_params(self, params: PoolingArg) -> PoolingParams:
        model = PoolingParams(normalize=self.engine.normalize, pooling_type=self.engine.pooling_type)
        defaults = self.model_config.pooling.over(model)
        if isinstance(params, dict):
            params = build(PoolingParams, params, source="<call>", prefix="pooling_params")
        if params is not None and not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, a dict or None, not {type(params).__name__}")
        merged = defaults if params is None else params.over(defaults)
        if merged.dimensions is not None and merged.dimensions > self.engine.hidden_size:
            raise RequestError(f"dimensions={merged.dimensions}: the model's embeddings have {self.engine.hidden_size}; "
                               f"ask for at most {self.engine.hidden_size}")
        return merged

    def _encode_texts(self, batch: Sequence[Prompt], truncates: Sequence[int | None]) -> dict[int, list[int]]:
        """Token ids of a batch's non-empty texts, one tokenizer call per truncation setting, as
        sentence-transformers tokenizes a batch: a fast (Rust) tokenizer encodes a list in parallel.
        Other tokenizers, and the prompts left out here, are tokenized one at a time by _pooling_input."""
        tokenizer = self.tokenizer()
        if not getattr(tokenizer, "is_fast", False):
            return {}
        limit = self.engine.max_seq_len
        groups: dict[int | None, list[int]] = {}
        for i, (prompt, truncate) in enumerate(zip(batch, truncates)):
            truncate = limit if truncate == -1 else truncate
            if isinstance(prompt, str) and prompt and (truncate is None or truncate <= limit):
                groups.setdefault(truncate, []).append(i)
        encoded: dict[int, list[int]] = {}
        for truncate, indices in groups.items():
            if len(indices) < 2:
                continue
            ids = tokenizer([batch[i] for i in indices], truncation=truncate is not None, max_length=truncate)["input_ids"]
            encoded.update((i, list(row)) for i, row in zip(indices, ids))
        return encoded

    def _pooling_input(self, prompt: Prompt, pair: str | None, truncate: int | None,
                       encoded: list[int] | None = None) -> PoolingInput:
        limit = self.engine.max_seq_len
        if truncate == -1:
            truncate = limit
        if truncate is not None and truncate > limit:
            raise RequestError(f"truncate_prompt_tokens={truncate}: the model takes at most {limit} tokens; "
                               "use -1 for the model's maximum")
        if isinstance(prompt, str):
            if not prompt or pair == "":
                raise RequestError("the text is empty: give a non-empty string")
            if encoded is not None:  # tokenized with the rest of its batch (_encode_texts)
                enc: Any = {"input_ids": encoded}
            else:
                enc = self.tokenizer()(prompt, pair, truncation=truncate is not None, max_length=truncate)
            ids = list(enc["input_ids"])
            types = list(enc["token_type_ids"]) if pair is not None and "token_type_ids" in enc else None
        elif pair is None and isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, types = list(prompt)[-truncate:] if truncate else list(prompt), None
            if not ids:
                raise RequestError("the prompt is empty: give at least one token id")
        else:
            raise RequestError(f"a prompt is a string{'' if pair is not None else ' or a list of token ids'}, "
                               f"not {type(prompt).__name__}: {prompt!r:.80}")
        if len(ids) > limit:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than the {limit} the model takes; shorten it, "
                               f"or pass PoolingParams(truncate_prompt_tokens=-1) to cut it to {limit}")
        return PoolingInput(ids, types)

    def _pool(self, items: list[PoolingInput], pooling_types: list[str | None]) -> list[Any]:
        futures = []
        try:
            for item, pooling_type in zip(items, pooling_types):
                futures.append(self.engine.pool(item, pooling_type))
            return [indexed(i, len(futures), _result, f) for i, f in enumerate(futures)]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _result(future: Any) -> Any:
    try:
        return future.result()
    except UnsupportedError:
        raise
    except Exception as exc:  # the engine failed on this prompt alone
        raise RequestError(str(exc)) from None


def _postprocess(row: Any, params: PoolingParams) -> list[float]:
    """vLLM's order: Matryoshka truncation, then normalization (eps as torch's F.normalize)."""
    import numpy as np

    vec = np.asarray(row, dtype=np.float32)
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec.tolist()


def _cosine(a: Any, b: Any, params: PoolingParams) -> float:
    import numpy as np

    va = np.asarray(_postprocess(a, params), dtype=np.float64)
    vb = np.asarray(_postprocess(b, params), dtype=np.float64)
    return float(va @ vb / max(np.linalg.norm(va) * np.linalg.norm(vb), 1e-12))


def _sigmoid(row: Any) -> float:
    import math

    return 1.0 / (1.0 + math.exp(-float(row[0])))


def _pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[Any], list[Any]]:
    """vLLM's pairing: 1 -> 1, 1 -> N (the first text repeated) or N -> N."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise RequestError("score needs at least one text on each side")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise RequestError(f"score pairs text_1 and text_2 one to one, or one text_1 with every text_2; got "
                           f"{len(firsts)} and {len(seconds)} texts")
    return firsts, seconds
