"""lmdock-llamacpp: GGUF models through llama.cpp, as a step engine.

This module is the entry point: it declares the backend, its options and the config translation, and
imports neither llama_cpp nor numpy.  The engine (``lmdock_llamacpp._engine``) and the tokenizer
(``lmdock_llamacpp._tokenizer``) are imported when a model loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

import lmdock
from lmdock import ModelConfig
from lmdock.backend import Backend, BackendSpec

__version__ = "0.1.0"

#: KV-cache element types llama.cpp's CPU backend takes (``--cache-type-k/-v`` in llama.cpp's tools).
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: kv_cache.dtype (portable) -> llama.cpp's KV type; "auto" is decided at load from the file's type.
_KV_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int8": "q8_0"}


@dataclass(frozen=True)
class LlamaCppOptions:
    """``[models.NAME.backends.llamacpp]``: options of the llama.cpp backend (llama.cpp's own names)."""

    #: Threads for decoding; None: one per physical core this process may run on.
    n_threads: int | None = None
    #: Threads for prompt processing (batches of many tokens); None: as n_threads.
    n_threads_batch: int | None = None
    #: KV cells shared by all sequences (tokens); None: kv_cache.max_tokens, else the model's context
    #: (build.max_seq_len or the GGUF's training context), as llama.cpp's server does.
    n_ctx: int | None = None
    #: Most tokens one llama_decode call takes; None: scheduler.max_num_batched_tokens.
    n_batch: int | None = None
    #: Physical micro-batch; None: min(n_batch, 512), llama.cpp's default.
    n_ubatch: int | None = None
    #: Most sequences held at once (running, beams and the next_token_logprobs prefix cache); None:
    #: scheduler.max_num_seqs * build.max_beam_width + 32, at most llama.cpp's limit (256).
    n_seq_max: int | None = None
    #: KV-cache types; None: from kv_cache.dtype, and for "auto" f32 for a float32 file, else f16
    #: (llama.cpp's default).
    type_k: Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"] | None = None
    type_v: Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"] | None = None
    #: Flash attention: llama.cpp decides ("auto"), or always / never.  None: "off" with an f32 KV
    #: cache (llama.cpp's CPU flash attention rounds through f16: logprob errors of 7e-3 instead of
    #: 1e-5 on stories260K), else "auto".
    flash_attn: Literal["auto", "on", "off"] | None = None
    #: Map the file instead of reading it into memory.
    use_mmap: bool = True
    #: Lock the weights in RAM (no swapping).
    use_mlock: bool = False
    #: Layers on the GPU in a CUDA / Metal / Vulkan build; None: from build.device ("cpu": 0, else all).
    n_gpu_layers: int | None = None
    #: llama.cpp's own log on stderr (loading, graph sizes); off by default.  Process-wide.
    verbose: bool = False

    def __post_init__(self) -> None:
        for name in ("n_threads", "n_threads_batch", "n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.n_seq_max is not None and self.n_seq_max > 256:
            raise ValueError(f"n_seq_max must be <= 256 (llama.cpp's LLAMA_MAX_SEQ), got {self.n_seq_max}")
        if self.n_gpu_layers is not None and self.n_gpu_layers < -1:
            raise ValueError(f"n_gpu_layers must be >= -1 (-1: all), got {self.n_gpu_layers}")


def _available() -> str | None:
    missing = [m for m in ("llama_cpp", "numpy", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        names = {"llama_cpp": "llama-cpp-python"}
        return f"{', '.join(names.get(m, m) for m in missing)} not installed; pip install lmdock-llamacpp"
    return None


def _engine_info() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"llama-cpp-python {version('llama-cpp-python')}"
    except PackageNotFoundError:
        return None


SPEC = BackendSpec(
    name="llamacpp",
    kind="step",
    plugin_api="1.0",
    supports=frozenset({"generate", "chat", "stream", "sampling", "logit_bias", "logprobs", "prompt_logprobs", "next_token_logprobs",
                        "beam_search", "quantization", "structured_output", "tools", "moe",
                        # forks and prefix reuse only at a recurrent state's whole length (docs/backends/llamacpp.md)
                        "recurrent_state"}),
    # families the family tests found exact although their feature is lacked in general (docs/model-families.md)
    family_support={"sliding_window": frozenset({"gemma2", "gpt_oss"}), "logit_softcapping": frozenset({"gemma2"}),
                    "attention_sinks": frozenset({"gpt_oss"})},
    # llama.cpp reads Gemma 3's layer pattern from the GGUF, defaulting to 6 (five sliding, one full); the converter
    # writes none, so the zoo's [sliding, full] checkpoint runs with both layers windowed (it matches transformers
    # with every layer sliding within 7e-4; plugins/mlx/tools/window_logits.py gives the 2.6 from the windowed reference)
    refuses_families={"gemma3_text": "llama.cpp's converter writes no layer pattern for Gemma 3, and llama.cpp then assumes "
                                     "five sliding layers to one full: the family tests' Gemma 3 (sliding, full) runs with its "
                                     "full layer windowed too (log-probabilities off by up to 2.6; greedy tokens differ, from the first on a 40-token prompt)"},
    lacks={
        "vision": "lmdock-llamacpp does not load llama.cpp's multimodal projector (mmproj) files yet (docs/vision.md)",
        "embed": "lmdock-llamacpp runs causal LMs; llama.cpp's embedding mode is not wired up yet",
        "score": "lmdock-llamacpp runs causal LMs; llama.cpp's reranking mode is not wired up yet",
        "offload": "no OffloadPolicy: llama.cpp maps the file (use_mmap) and places layers with n_gpu_layers",
        "lora": "not wired yet: llama-cpp-python takes adapters per model (lora_path), not per request (issue 33)",
        # model features: what lmdock-conformance's family tests found (docs/model-families.md)
        "sliding_window": "unverified beyond Gemma 2 and gpt-oss (exact in the family tests, past their windows): llama.cpp "
                          "runs Phi-3 without its window (it disables Phi SWA at load; the family tests' Phi-3 diverges "
                          "past its 16-token window, from token 1 after a 40-token prompt) and llama.cpp's converter drops "
                          "Mistral's and Qwen2's windows (their GGUFs hold none)",
        "attention_sinks": "unverified beyond gpt-oss (exact in the family tests)",
        "logit_softcapping": "unverified beyond Gemma 2 (exact in the family tests)",
    },
    requires=("llama_cpp", "numpy", "jinja2"),
    engine_packages=("llama-cpp-python",),  # its low-level C API (docs/authoring-backends.md)
    package="lmdock-llamacpp",
    version=__version__,
    available=_available,
    engine_info=_engine_info,
    options=LlamaCppOptions,
    # measured on stories260K.gguf (float32, f32 KV, no flash attention) against the transformers
    # float32 reference: 9.6e-6 at most over the conformance positions (docs/backends/llamacpp.md)
    tolerances={"logprobs": 1e-4},
    model_formats=frozenset({"gguf"}),
    priority=20,
    description="GGUF files through llama.cpp (quantized or not)",
)


def _quantize(quant: lmdock.QuantConfig, model_config: ModelConfig) -> Any:
    if not quant.checkpoint_prequantized:
        raise lmdock.UnsupportedError(
            f"quantization {quant.algo!r}: lmdock-llamacpp runs a GGUF file as it is and does not re-quantize it. "
            "Quantize the file with llama.cpp's tool, e.g. `llama-quantize model-f32.gguf model-q8_0.gguf Q8_0` "
            "(Q4_K_M for 4 bits), load the result, and set checkpoint_prequantized = true to check it is quantized"
        )
    return {"algo": quant.algo, "prequantized": True}


def _build(model_config: ModelConfig) -> dict[str, Any] | None:
    b, kv = model_config.build, model_config.kv_cache
    if b.dtype not in ("auto", "float32"):
        raise lmdock.UnsupportedError(f"build.dtype {b.dtype!r}: llama.cpp computes in the GGUF file's own types; "
                                      "remove build.dtype, or convert the file (convert_hf_to_gguf.py --outtype f16)")
    if kv.dtype == "fp8":
        raise lmdock.UnsupportedError("kv_cache.dtype 'fp8': llama.cpp has no fp8 KV cache; use 'int8' (q8_0), "
                                      "'float16' or 'auto', or set type_k/type_v in [backends.llamacpp]")
    sched = model_config.scheduler
    return {
        "device": b.device,
        "max_seq_len": b.max_seq_len,
        "max_num_seqs": sched.max_num_seqs * b.max_beam_width,
        "max_num_batched_tokens": b.max_num_tokens or sched.max_num_batched_tokens,
        "kv_type": _KV_DTYPES.get(kv.dtype),  # None: "auto"
        "kv_max_tokens": kv.max_tokens,
    }


def _load(model_config: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    from lmdock_llamacpp._engine import load

    return load(model_config, options, quantization, build)


#: what the entry point names: the spec and the functions above (lmdock.backend.Backend)
plugin = Backend(SPEC, load=_load, build=_build, quantize=_quantize)
