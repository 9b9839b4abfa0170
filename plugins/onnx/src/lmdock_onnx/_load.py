"""From a model config to an engine: use an exported folder as it is, or export (once) and cache."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from lmdock import BackendError, ModelConfig, UnsupportedError
from lmdock.backend import read_model_json

from lmdock_onnx import __version__
from lmdock_onnx._cache import cache_root, export_atomically, export_dir, export_key, export_log


def is_exported(folder: Path) -> bool:
    """A folder that already holds a model in lmdock-onnx's convention (docs/backends/onnx.md)."""
    return (folder / "model.onnx").is_file() or (folder / "genai_config.json").is_file()


def resolve(mc: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Path:
    """The folder to load: ``mc.model`` when it is exported already, else the cached export of it."""
    folder = _local(mc)
    quant = quantization or {}
    if is_exported(folder):
        if quant.get("algo"):
            raise UnsupportedError(
                f"{folder} is already an ONNX model; lmdock-onnx quantizes while exporting a transformers "
                "checkpoint. Point the model at the checkpoint, or set checkpoint_prequantized = true if the "
                "folder is quantized already"
            )
        return folder
    if quant.get("prequantized"):
        raise UnsupportedError(f"checkpoint_prequantized = true, but {folder} is not an exported ONNX model "
                               "(no model.onnx); remove it to export and quantize the checkpoint here")
    if not (folder / "config.json").is_file():
        raise BackendError(f"{folder} holds neither model.onnx nor a transformers config.json; "
                           "pass an exported ONNX folder or a transformers checkpoint")
    precision = build["dtype"] + (f"-{quant['algo']}-g{quant.get('group_size') or 'default'}" if quant.get("algo") else "")
    root = cache_root(options.cache_dir)
    key = export_key(folder, opset=options.opset, precision=precision, plugin_version=__version__)
    out = export_dir(root, folder, key)
    if (out / "lmdock_onnx.json").is_file():
        return out
    _export_to(out, mc, folder, options, build["dtype"], precision, quant)
    return out


def _local(mc: ModelConfig) -> Path:
    folder = Path(mc.model).expanduser()
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise BackendError(f"{mc.model!r} is not a folder, and huggingface_hub (for hub ids) is not installed") from None
    try:
        return Path(snapshot_download(mc.model, revision=mc.revision))
    except Exception as exc:
        raise BackendError(f"{mc.model!r} is not a folder and could not be fetched from the Hugging Face hub: {exc}. "
                           "With HF_HUB_OFFLINE=1 it must already be in the hub cache.") from exc


def _export_to(out: Path, mc: ModelConfig, folder: Path, options: Any, dtype: str, precision: str, quant: dict[str, Any]) -> None:
    from lmdock_onnx import _export  # its heavy imports are inside its functions

    missing = [m for m in ("torch", "transformers", "onnx") if _importable(m) is False]
    if missing:
        raise UnsupportedError(f"exporting {folder} to ONNX needs {', '.join(missing)}: pip install torch==<your build> "
                               "'lmdock-onnx[export]'; or load a folder exported already (docs/backends/onnx.md)")
    started = time.perf_counter()

    def make(tmp: Path) -> None:
        with _export.captured(export_log(out)):
            _make(tmp)
        export_log(out).unlink(missing_ok=True)  # kept only when the export fails

    def _make(tmp: Path) -> None:
        facts = _export.export(str(folder), tmp, dtype=dtype, opset=options.opset, trust_remote_code=mc.trust_remote_code,
                               revision=mc.revision, tokenizer=mc.tokenizer)
        if quant.get("algo"):
            _export.quantize(tmp, quant["algo"], quant.get("group_size"))
        _export.write_meta(tmp, {**facts, "source": str(folder), "opset": options.opset, "precision": precision,
                                 "lmdock_onnx": __version__, "present": "new", "export_seconds": round(time.perf_counter() - started, 2)})

    export_atomically(out, folder, make)
    sys.stderr.write(f"lmdock-onnx: cached at {out}\n")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def load(mc: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> Any:
    import onnxruntime as ort

    from lmdock_onnx._engine import OnnxStepEngine, providers, read_layout, session_options

    folder = resolve(mc, options, quantization, build)
    config = read_model_json(str(folder), "config.json")
    genai = read_model_json(str(folder), "genai_config.json").get("model", {})
    decoder = genai.get("decoder", {})
    model_file = folder / decoder.get("filename", "model.onnx")
    try:
        session = ort.InferenceSession(str(model_file), sess_options=session_options(options),
                                       providers=providers(build.get("device", "auto"), options.providers))
    except UnsupportedError:
        raise
    except Exception as exc:
        raise BackendError(f"onnxruntime could not load {model_file}: {exc}") from exc
    layout = read_layout(session, folder, decoder, _kv_hints(config, decoder))
    meta = read_model_json(str(folder), "lmdock_onnx.json")
    if meta.get("present"):
        layout.present = meta["present"]
    tokenizer = _tokenizer(mc, folder)
    limit = int(config.get("max_position_embeddings") or genai.get("context_length") or 2048)
    max_seq_len = min(build["max_seq_len"], limit) if build.get("max_seq_len") else limit
    vocab = layout.vocab_size or int(config.get("vocab_size") or genai.get("vocab_size") or len(tokenizer))
    generation_config = read_model_json(str(folder), "generation_config.json") or read_model_json(mc.model, "generation_config.json")
    engine = OnnxStepEngine(
        session, layout, tokenizer, eos=_eos(generation_config, config, genai, tokenizer), max_seq_len=max_seq_len,
        vocab_size=vocab, generation_config=generation_config, kv_max_tokens=build.get("kv_max_tokens"), folder=folder,
        contiguous_past=has_window(config),
    )
    if not meta.get("present"):
        engine.probe()
    return engine


def has_window(config: dict[str, Any]) -> bool:
    """Whether some layer attends over a sliding window (Mistral, Phi-3, Qwen2 with use_sliding_window,
    Gemma 2/3's sliding layers...): the engine then passes a contiguous past (see _engine)."""
    text = config.get("text_config") or config
    if not text.get("sliding_window") or text.get("use_sliding_window") is False:
        return False
    types = text.get("layer_types")
    return types is None or "sliding_attention" in types


def _kv_hints(config: dict[str, Any], decoder: dict[str, Any]) -> dict[str, int | None]:
    heads = config.get("num_attention_heads") or decoder.get("num_attention_heads")
    head_dim = config.get("head_dim") or decoder.get("head_size")
    if not head_dim and heads and config.get("hidden_size"):
        head_dim = config["hidden_size"] // heads
    return {"kv_heads": config.get("num_key_value_heads") or decoder.get("num_key_value_heads") or heads, "head_dim": head_dim}


def _tokenizer(mc: ModelConfig, folder: Path) -> Any:
    from transformers import AutoTokenizer

    source = mc.tokenizer or str(folder)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=mc.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise BackendError(f"lmdock-onnx could not load a tokenizer from {source!r}: {exc}. Put tokenizer.json "
                           "(and tokenizer_config.json) beside model.onnx, or set the model's tokenizer") from exc


def _eos(generation_config: dict[str, Any], config: dict[str, Any], genai: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (generation_config.get("eos_token_id"), config.get("eos_token_id"), genai.get("eos_token_id"), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids += [int(v) for v in value]
        if ids:
            break
    return tuple(dict.fromkeys(ids))

