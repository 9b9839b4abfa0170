"""The vLLM model class for Bamba (imported by vLLM's model registry only; see ``_bamba``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM

from lmdock_vllm._bamba import renamed


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """vLLM's Granite 4 hybrid, loading a Bamba checkpoint under its own names."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(renamed(weights))
