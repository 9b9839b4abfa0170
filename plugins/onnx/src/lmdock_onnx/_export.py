"""Export a transformers causal LM to ONNX with KV-cache inputs and outputs, and quantize it.

Needs torch, transformers and onnx (``pip install "lmdock-onnx[export]"``); the engine does not.

The exported graph follows lmdock's folder convention (docs/backends/onnx.md):

* inputs ``input_ids`` [batch, seq] int64, ``attention_mask`` [batch, past + seq] int64,
  ``position_ids`` [batch, seq] int64, ``past_key_values.{i}.key`` / ``.value``
  [batch, kv_heads, past, head_dim];
* outputs ``logits`` [batch, seq, vocab] and ``present.{i}.key`` / ``.value`` holding the **new
  positions only** [batch, kv_heads, seq, head_dim]: the engine writes them into its preallocated
  cache, so no step returns (or copies) the whole cache.

The attention mask may have holes (zeros between a row's past and its new tokens): that is how the
engine runs rows at different positions in one batch over one fixed-size past.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmdock import UnsupportedError

OPSET = 17
#: config.json keys of layers that keep a recurrent (convolution or state-space) state: a graph with
#: only KV inputs and outputs cannot carry it (transformers' own cache says "Cannot get conv state")
_RECURRENT_KEYS = ("mamba_d_state", "ssm_state_size", "conv_L_cache", "linear_conv_kernel_dim", "attn_layer_indices", "state_size")
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention", "global_attention", "local_attention"}


#: the terminal's stderr while :func:`captured` sends file descriptor 2 to the export's log
_terminal: Any = None


def _say(message: str) -> None:
    out = _terminal or sys.stderr
    out.write(f"lmdock-onnx: {message}\n")
    out.flush()


@contextlib.contextmanager
def captured(log: Path) -> Iterator[None]:
    """Send everything written to stderr (file descriptor 2, so torch's C++ log too: on a failure it
    prints the whole traced graph, thousands of lines) to ``log``; progress lines still reach the
    terminal.  Process-wide while it lasts, as file descriptor 2 is: an export runs during a load."""
    global _terminal
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("w", encoding="utf-8") as sink:
        os.dup2(sink.fileno(), 2)
        _terminal = os.fdopen(os.dup(saved), "w", encoding="utf-8", errors="replace")
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            _terminal.close()
            _terminal = None


def refuse_recurrent(config: dict[str, Any], model: str) -> None:
    """Refuse a model whose layers keep a convolution or state-space state (Mamba, LFM2 conv, hybrids)."""
    kinds = sorted({str(k) for k in config.get("layer_types") or []} - _ATTENTION_LAYERS)
    keys = [k for k in _RECURRENT_KEYS if config.get(k) is not None]
    if kinds or keys:
        what = f"layer types {kinds}" if kinds else f"{keys[0]} in its config"
        raise UnsupportedError(
            f"{model} ({config.get('model_type', 'unknown family')}) has layers with a recurrent (convolution or state-space) "
            f"state ({what}); lmdock-onnx's graphs carry attention KV only and cannot export it. Use the hf or vllm backend"
        )


def exportable_experts(lm: Any) -> None:
    """Mixture-of-experts layers through transformers' "batched_mm" experts: a gather and a batched
    matmul per layer, which traces (the default "grouped_mm" counts tokens per expert with
    ``aten::histc``, which ONNX lacks; "eager" loops over the experts a token hit, which a trace
    would freeze to the example's)."""
    can = getattr(lm, "_can_set_experts_implementation", None)
    if can is not None and can():
        lm.set_experts_implementation("batched_mm")


def export(model: str, out: Path, *, dtype: str, opset: int, trust_remote_code: bool, revision: str | None, tokenizer: str | None) -> dict[str, Any]:
    """Write ``out/model.onnx`` (+ tokenizer files) and return the layout facts the engine needs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)
    text = config.get_text_config()
    refuse_recurrent(text.to_dict(), model)
    _say(f"exporting {model} to ONNX (opset {opset}, {dtype}); done once, then cached")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    lm = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch_dtype, attn_implementation="eager", trust_remote_code=trust_remote_code, revision=revision
    ).eval()
    lm.requires_grad_(False)
    exportable_experts(lm)
    layers = int(text.num_hidden_layers)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    _say(f"  loaded: {layers} layers, {kv_heads} KV heads of {head_dim}; tracing")

    wrapper = _kv_wrapper(lm, layers)
    past_names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    batch, past, seq = 2, 3, 4  # example shapes; every axis below is dynamic
    example = (
        torch.zeros((batch, seq), dtype=torch.int64),
        torch.ones((batch, past + seq), dtype=torch.int64),
        torch.arange(past, past + seq).expand(batch, seq).contiguous(),
        *[torch.zeros((batch, kv_heads, past, head_dim), dtype=torch_dtype) for _ in past_names],
    )
    dynamic = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"}, "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    dynamic |= {n: {0: "batch", 2: "past"} for n in past_names}
    dynamic |= {n: {0: "batch", 2: "seq"} for n in present_names}
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(
            wrapper, example, str(out / "model.onnx"),
            input_names=["input_ids", "attention_mask", "position_ids", *past_names],
            output_names=["logits", *present_names],
            dynamic_axes=dynamic, opset_version=opset, dynamo=False, do_constant_folding=True,
        )
    _say(f"  traced and written ({_size(out)}); saving the tokenizer")
    AutoTokenizer.from_pretrained(tokenizer or model, trust_remote_code=trust_remote_code, revision=revision).save_pretrained(out)
    for name in ("generation_config.json", "config.json"):
        src = Path(model) / name
        if src.is_file():
            (out / name).write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    if not (out / "config.json").is_file():
        config.to_json_file(out / "config.json")
    _say(f"  export finished in {time.perf_counter() - started:.1f} s")
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "vocab_size": int(text.vocab_size), "dtype": dtype}


def _kv_wrapper(lm: Any, layers: int) -> Any:
    """A module around a transformers causal LM: flat KV tensors in, the new positions' KV out."""
    import torch
    from transformers import DynamicCache

    class KvWrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache, use_cache=True)
            seq = input_ids.shape[1]
            present: list[Any] = []
            for layer in out.past_key_values.layers[:layers]:
                present += [layer.keys[:, :, -seq:], layer.values[:, :, -seq:]]
            return (out.logits, *present)

    return KvWrapper()


def quantize(folder: Path, algo: str, group_size: int | None) -> None:
    """Quantize ``folder/model.onnx`` in place with onnxruntime.quantization."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    started = time.perf_counter()
    src = folder / "model.onnx"
    tmp = folder / "model.quant.onnx"
    _say(f"  quantizing ({algo}) with onnxruntime.quantization")
    if algo == "int8_dynamic":
        # int8 weights, activations quantized per batch at run time (MatMulInteger / DynamicQuantizeMatMul)
        quantize_dynamic(src, tmp, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"])
    else:  # int8_weight_only / int4_weight_only: MatMulNBits, weights in blocks, float activations
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        bits = 8 if algo == "int8_weight_only" else 4
        quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=bits, block_size=group_size or 32, is_symmetric=True)
        quantizer.process()
        quantizer.model.save_model_to_file(str(tmp), use_external_data_format=False)
    tmp.replace(src)
    _say(f"  quantized in {time.perf_counter() - started:.1f} s ({_size(folder)})")


def _size(folder: Path) -> str:
    total = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return f"{total / 2**20:.1f} MiB"


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    (folder / "lmdock_onnx.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
