"""The ONNX Runtime pooling engine: embedding models and cross-encoders.

A transformers encoder (``AutoModel``: its ``last_hidden_state``) or one-label sequence classifier
(``AutoModelForSequenceClassification``: its ``logits``) is exported once with dynamic batch and
sequence axes and cached like the causal exports: ``<cache>/<folder>-<key>/`` where the key hashes the
model's files, the opset, the precision (with the task) and this plugin's version.  The export holds
``model.onnx``, config.json, the tokenizer and the sentence-transformers pooling files, so it also
loads as a folder of its own.  Pooling (CLS, masked MEAN, LAST) runs in NumPy on the hidden states.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lmdock import BackendError, ModelConfig, UnsupportedError
from lmdock.backend import PoolingEngineBase, PoolingInput, pool_hidden

from lmdock_onnx import __version__
from lmdock_onnx._cache import cache_root, export_atomically, export_dir, export_key

#: The files beside the weights that an export keeps (sentence-transformers' pooling among them).
_KEEP = ("config.json", "modules.json", "sentence_bert_config.json", "1_Pooling", "2_Normalize")


def resolve(mc: ModelConfig, options: Any, build: dict[str, Any], task: str) -> Path:
    """``mc.model`` when it holds ``model.onnx`` already, else its cached export (made on first use)."""
    folder = Path(mc.model).expanduser()
    if not folder.is_dir():
        raise BackendError(f"lmdock-onnx exports embedding models from a local folder; {mc.model!r} is not one")
    if (folder / "model.onnx").is_file():
        return folder
    precision = f"{build['dtype']}-{task}"
    key = export_key(folder, opset=options.opset, precision=precision, plugin_version=__version__)
    out = export_dir(cache_root(options.cache_dir), folder, key)
    if (out / "model.onnx").is_file():
        return out
    started = time.perf_counter()
    export_atomically(out, folder, lambda tmp: _export(mc, folder, tmp, task, build["dtype"], options.opset))
    sys.stderr.write(f"lmdock-onnx: exported {folder.name} in {time.perf_counter() - started:.1f} s, cached at {out}\n")
    return out


def _export(mc: ModelConfig, folder: Path, out: Path, task: str, dtype: str, opset: int) -> None:
    try:
        import torch
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer
    except ImportError as exc:
        raise UnsupportedError(f"exporting {folder} to ONNX needs torch and transformers: pip install torch==<your build> "
                               f"'lmdock-onnx[export]' ({exc})") from None
    auto = AutoModelForSequenceClassification if task == "classify" else AutoModel
    model = auto.from_pretrained(str(folder), dtype=getattr(torch, dtype), attn_implementation="eager",
                                 trust_remote_code=mc.trust_remote_code).eval()
    tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or str(folder), trust_remote_code=mc.trust_remote_code)
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if "token_type_ids" in tokenizer.model_input_names else [])
    output = "logits" if task == "classify" else "last_hidden_state"

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: Any) -> Any:
            return getattr(self.model(**dict(zip(names, inputs))), output)

    example = tuple(torch.ones((2, 5), dtype=torch.long) for _ in names)
    dynamic = {n: {0: "batch", 1: "seq"} for n in names} | {output: {0: "batch"} if task == "classify" else {0: "batch", 1: "seq"}}
    out.mkdir(parents=True)
    with torch.no_grad():
        torch.onnx.export(Wrapper(), example, str(out / "model.onnx"), input_names=names, output_names=[output],
                          dynamic_axes=dynamic, opset_version=opset, dynamo=False, do_constant_folding=True)
    tokenizer.save_pretrained(out)
    for name in _KEEP:
        src = folder / name
        if src.is_dir():
            shutil.copytree(src, out / name)
        elif src.is_file():
            shutil.copy2(src, out / name)


class OnnxPoolingEngine(PoolingEngineBase):
    """``lmdock.backend.PoolingEngine`` over an ONNX Runtime session of an encoder or classifier."""

    def __init__(self, session: Any, tokenizer: Any, task: str, max_seq_len: int, st: dict[str, Any], hidden_size: int) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.task = task
        self.max_seq_len = max_seq_len
        self.pooling_type = st["pooling_type"]
        self.normalize = st["normalize"] if task == "embed" else False
        self.hidden_size = hidden_size
        self.inputs = [i.name for i in session.get_inputs()]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @classmethod
    def load(cls, mc: ModelConfig, options: Any, build: dict[str, Any], st: dict[str, Any]) -> OnnxPoolingEngine:
        import onnxruntime as ort
        from lmdock.backend import read_model_json, read_pooling_config
        from transformers import AutoTokenizer

        from lmdock_onnx._engine import providers, session_options

        folder = resolve(mc, options, build, st["task"])
        st = {**read_pooling_config(folder), "task": st["task"]}
        config = read_model_json(str(folder), "config.json")
        try:
            session = ort.InferenceSession(str(folder / "model.onnx"), sess_options=session_options(options),
                                           providers=providers(build.get("device", "auto"), options.providers))
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except UnsupportedError:
            raise
        except Exception as exc:
            raise BackendError(f"lmdock-onnx could not load {folder}: {exc}") from exc
        if st["task"] == "classify" and int(config.get("num_labels", len(config.get("id2label", {})) or 1)) != 1:
            raise UnsupportedError(f"{mc.model!r} is a classifier with several labels; LLM.score needs a cross-encoder with one label")
        limit = st["max_seq_len"] or min(int(config.get("max_position_embeddings", 512)), getattr(tokenizer, "model_max_length", 1 << 30))
        max_seq_len = min(build["max_seq_len"], limit) if build.get("max_seq_len") else limit
        hidden = 1 if st["task"] == "classify" else int(config["hidden_size"])
        return cls(session, tokenizer, st["task"], max_seq_len, st, hidden)

    def embed(self, batch: Sequence[PoolingInput], pooling_type: str) -> np.ndarray:
        width = max(len(item.token_ids) for item in batch)
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        types = np.zeros((len(batch), width), dtype=np.int64)
        for row, item in enumerate(batch):
            n = len(item.token_ids)
            ids[row, :n], mask[row, :n] = item.token_ids, 1
            if item.token_type_ids:
                types[row, :n] = item.token_type_ids
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        (out,) = self.session.run(None, {name: feed[name] for name in self.inputs})
        out = out.astype(np.float32, copy=False)
        return out if self.task == "classify" else pool_hidden(out, mask, pooling_type)

    def close(self) -> None:
        self.session = None

