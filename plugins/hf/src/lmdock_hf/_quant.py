"""Quantization on lmdock-hf: weights quantized at load through torchao, or a pre-quantized checkpoint.

``plan()`` runs in the entry-point module's hook (it imports neither torch nor torchao) and turns a
portable ``QuantConfig`` into what ``apply()`` does at load, or refuses by name.  torchao is the
maintained library for this: ``torch.ao.quantization`` is deprecated (it says so at import), and
torchao's int8 and int4 workflows run on CPUs and on CUDA.

- ``int8_weight_only``: int8 weights, one scale per output channel (torchao ``Int8WeightOnlyConfig``).
- ``int8_dynamic``: int8 weights per channel and activations quantized per token at each matmul
  (``Int8DynamicActivationInt8WeightConfig``).
- ``int4_weight_only``: 4-bit weights in groups of ``group_size`` (default 64, FlexLLMGen's) along
  the input dimension.  On CUDA in bfloat16: torchao's tinygemm kernel, weights packed two
  per byte (``Int4WeightOnlyConfig``, tile-packed layout); elsewhere torchao has no packed int4 kernel
  for x86 CPUs, so the 4-bit values are held one per byte (``IntxWeightOnlyConfig``): int4's
  accuracy, int8's memory.  A linear layer whose input size the group does not divide keeps one
  scale per output channel.
- ``gptq``, ``awq``: checkpoints quantized elsewhere (``checkpoint_prequantized = true``), loaded by
  transformers from their ``quantization_config`` where it can (gptqmodel, optimum, accelerate).
- ``fp8``: refused.

The LM head is quantized too, unless it is tied to the input embeddings (an embedding lookup stays
float).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from lmdock import QuantConfig, UnsupportedError

TORCHAO = ("int8_weight_only", "int8_dynamic", "int4_weight_only")
PREQUANTIZED = {  # transformers' quant_method -> what transformers needs to load it
    "gptq": ("gptqmodel", "optimum"),
    "awq": ("gptqmodel", "accelerate"),
}


def plan(quant: QuantConfig, model: str) -> dict[str, Any]:
    """What ``apply()`` will do, checked before anything loads; UnsupportedError names the algorithm."""
    algo = quant.algo
    if algo in TORCHAO:
        if quant.checkpoint_prequantized:
            raise UnsupportedError(
                f"quantization {algo!r} with checkpoint_prequantized = true: lmdock-hf quantizes a float checkpoint "
                "as it loads; the pre-quantized checkpoints it loads are gptq and awq. Remove checkpoint_prequantized"
            )
        if quant.group_size is not None and algo != "int4_weight_only":
            raise UnsupportedError(f"quantization {algo!r} keeps one scale per output channel; group_size applies to int4_weight_only only")
        if importlib.util.find_spec("torchao") is None:
            raise UnsupportedError(f"quantization {algo!r} on lmdock-hf needs torchao: pip install \"lmdock-hf[quant]\"")
        group = (quant.group_size or 64) if algo == "int4_weight_only" else None
        return {"algo": algo, "group_size": group}
    if algo in PREQUANTIZED:
        if not quant.checkpoint_prequantized:
            raise UnsupportedError(
                f"quantization {algo!r}: lmdock-hf does not quantize to {algo.upper()} itself (that takes calibration data); "
                f"point the model at a {algo.upper()} checkpoint and set checkpoint_prequantized = true"
            )
        method = _checkpoint_quant_method(model)
        if method != algo:
            found = f"its config.json says quant_method = {method!r}" if method else "its config.json has no quantization_config"
            raise UnsupportedError(f"quantization {algo!r} with checkpoint_prequantized = true, but {model!r} is not a {algo.upper()} checkpoint: {found}")
        missing = [m for m in PREQUANTIZED[algo] if importlib.util.find_spec(m) is None]
        if missing:
            raise UnsupportedError(f"quantization {algo!r}: transformers loads {algo.upper()} checkpoints through {' and '.join(PREQUANTIZED[algo])}; pip install {' '.join(missing)}")
        return {"algo": algo, "prequantized": True}
    raise UnsupportedError(
        f"quantization {algo!r} is not implemented in lmdock-hf (fp8 weights need a GPU of compute capability 8.9+: "
        "lmdock-vllm or lmdock-trtllm run them); lmdock-hf has int8_weight_only, int8_dynamic, int4_weight_only, "
        "and pre-quantized gptq and awq checkpoints"
    )


def _checkpoint_quant_method(model: str) -> str | None:
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        qc = json.loads(path.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return None
    return qc.get("quant_method")


def apply(model: Any, spec: dict[str, Any]) -> None:
    """Quantize ``model``'s linear layers in place (a pre-quantized checkpoint is left as loaded)."""
    if spec.get("prequantized"):
        return
    import torch
    from torchao.quantization import quantize_

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    group = spec["group_size"]

    def linear(module: Any, _fqn: str = "") -> bool:
        return isinstance(module, torch.nn.Linear) and not (tied and module is head)

    algo = spec["algo"]
    if algo != "int4_weight_only":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

        quantize_(model, Int8WeightOnlyConfig() if algo == "int8_weight_only" else Int8DynamicActivationInt8WeightConfig(), filter_fn=linear)
        return
    from torchao.quantization import Int4WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    weight = next(model.parameters())
    if weight.device.type == "cuda" and weight.dtype == torch.bfloat16:  # torchao's tile-packed int4 takes bfloat16 only
        grouped: Any = Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d")
    else:
        grouped = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group))
    quantize_(model, grouped, filter_fn=lambda m, _f="": linear(m) and m.in_features % group == 0)
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerAxis(0)),  # the rest: one scale per channel
              filter_fn=lambda m, _f="": linear(m) and m.in_features % group != 0)
