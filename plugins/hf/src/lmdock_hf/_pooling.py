"""The transformers pooling engine: embedding models and cross-encoders.

* An encoder (``BertModel``, a sentence-transformers folder...) loads through ``AutoModel``; ``embed``
  pools its last hidden states (CLS, MEAN over the attention mask, or LAST) as sentence-transformers'
  ``Pooling`` module does.
* A sequence classifier with one label (a cross-encoder) loads through
  ``AutoModelForSequenceClassification``; ``embed`` returns its logits and the core applies the
  sigmoid, as sentence-transformers' ``CrossEncoder`` does.

The core batches, tokenizes, normalizes and truncates dimensions (``lmdock.backend.PoolingEngine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmdock import BackendError, ModelConfig, UnsupportedError
from lmdock.backend import PoolingEngineBase, PoolingInput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pad_batch(batch: Sequence[PoolingInput], pad_id: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Right-padded ids, attention mask and segment ids (zeros where the tokenizer gave none)."""
    width = max(len(item.token_ids) for item in batch)
    ids, mask, types = [], [], []
    for item in batch:
        pad = width - len(item.token_ids)
        ids.append(list(item.token_ids) + [pad_id] * pad)
        mask.append([1] * len(item.token_ids) + [0] * pad)
        types.append(list(item.token_type_ids or [0] * len(item.token_ids)) + [0] * pad)
    return ids, mask, types


class HFPoolingEngine(PoolingEngineBase):
    """``lmdock.backend.PoolingEngine`` over a transformers encoder or one-label classifier."""

    def __init__(self, model: Any, tokenizer: Any, task: str, device: torch.device, max_seq_len: int, st: dict[str, Any]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.task = task
        self.device = device
        self.max_seq_len = max_seq_len
        self.pooling_type = st["pooling_type"]
        self.normalize = st["normalize"] if task == "embed" else False
        self.hidden_size = model.config.hidden_size if task == "embed" else model.config.num_labels
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.use_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())

    @classmethod
    def load(cls, mc: ModelConfig, options: Any, build: dict[str, Any], st: dict[str, Any], quantization: dict[str, Any] | None = None) -> HFPoolingEngine:
        """``st``: ``lmdock.backend.read_pooling_config(mc.model)``; ``quantization``: ``lmdock_hf._quant.plan``'s."""
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        name = build.get("device", "auto")
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
        dtype = _DTYPES.get(build.get("dtype", "auto"), torch.float32)
        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": mc.trust_remote_code, "revision": mc.revision}
        if options.attn_implementation != "auto":
            kwargs["attn_implementation"] = options.attn_implementation
        task = st["task"]
        auto = AutoModelForSequenceClassification if task == "classify" else AutoModel
        try:
            tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model, trust_remote_code=mc.trust_remote_code, revision=mc.revision)
            model = auto.from_pretrained(mc.model, **kwargs)
        except (OSError, ValueError) as exc:
            raise BackendError(f"lmdock-hf could not load {mc.model!r} as an {'cross-encoder' if task == 'classify' else 'embedding model'}: {exc}") from exc
        if task == "classify" and model.config.num_labels != 1:
            raise UnsupportedError(f"{mc.model!r} is a classifier with {model.config.num_labels} labels; LLM.score needs a "
                                   "cross-encoder with one label")
        model.to(device).eval().requires_grad_(False)
        if quantization:
            from lmdock_hf._quant import apply

            apply(model, quantization)
        limit = st["max_seq_len"] or min(model.config.max_position_embeddings, getattr(tokenizer, "model_max_length", 1 << 30))
        max_seq_len = min(build["max_seq_len"], limit) if build.get("max_seq_len") else limit
        return cls(model, tokenizer, task, device, max_seq_len, st)

    @torch.inference_mode()
    def embed(self, batch: Sequence[PoolingInput], pooling_type: str) -> Any:
        ids, mask, types = pad_batch(batch, self.pad_id)
        inputs = {"input_ids": torch.tensor(ids, device=self.device), "attention_mask": torch.tensor(mask, device=self.device)}
        if self.use_types:
            inputs["token_type_ids"] = torch.tensor(types, device=self.device)
        out = self.model(**inputs)
        if self.task == "classify":
            return out.logits.float().cpu().numpy()
        return pool(out.last_hidden_state.float(), inputs["attention_mask"], pooling_type).cpu().numpy()

    def close(self) -> None:
        self.model = None


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """sentence-transformers' ``Pooling``: CLS, masked MEAN (sum / clamp(count, 1e-9)), or LAST (right padding)."""
    if pooling_type == "CLS":
        return hidden[:, 0]
    if pooling_type == "LAST":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
