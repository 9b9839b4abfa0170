"""Where exported models live, and the key that says whether an export can be reused.

An export is kept under ``<cache dir>/<model name>-<key>/``, where the key hashes the model's files
(config, weights, tokenizer: their bytes, not their paths or dates), the opset, the precision
(dtype and quantization) and this plugin's version.  Change any of them and the next load exports
again; change none and it loads the folder as it is.  The folder appears only once complete (written
under a temporary name, then renamed), so an interrupted export is never mistaken for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

from lmdock import BackendError, UnsupportedError

#: Files of a transformers checkpoint that decide what the export holds.
_MODEL_FILES = (".json", ".safetensors", ".bin", ".model", ".txt", ".py", ".tiktoken")
_CHUNK = 1 << 20


def _first_line(exc: BaseException, limit: int = 300) -> str:
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


def cache_root(option: str | None) -> Path:
    """The option, else ``$LMDOCK_CACHE_DIR/onnx``, else ``$XDG_CACHE_HOME/lmdock/onnx`` (``~/.cache``)."""
    if option:
        return Path(option).expanduser()
    if os.environ.get("LMDOCK_CACHE_DIR"):
        return Path(os.environ["LMDOCK_CACHE_DIR"]).expanduser() / "onnx"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmdock" / "onnx"


def model_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _MODEL_FILES)


def export_key(folder: Path, *, opset: int, precision: str, plugin_version: str) -> str:
    digest = hashlib.sha256()
    for name in (f"opset={opset}", f"precision={precision}", f"lmdock-onnx={plugin_version}"):
        digest.update(name.encode() + b"\0")
    for path in model_files(folder):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(_CHUNK):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def export_dir(root: Path, folder: Path, key: str) -> Path:
    return root / f"{folder.name}-{key}"


def export_log(out: Path) -> Path:
    """Where the export into ``out`` writes what torch and transformers print (kept after a failure)."""
    return out.with_name(out.name + ".export.log")


def export_atomically(out: Path, folder: Path, make: Callable[[Path], None]) -> None:
    """``make(tmp)`` writes the export into ``out``'s ``.partial`` sibling, which then becomes ``out``:
    the folder appears only once complete.  A failure leaves nothing behind but the export's log;
    lmdock's own errors pass as they are, anything else becomes a BackendError naming ``folder``, in
    one line that points at the log for the details."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        make(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (BackendError, UnsupportedError)):
            raise
        log = export_log(out)
        with contextlib.suppress(OSError), log.open("a", encoding="utf-8") as f:
            traceback.print_exception(exc, file=f)
        raise BackendError(f"exporting {folder} to ONNX failed: {type(exc).__name__}: {_first_line(exc)} "
                           f"(the full log: {log})") from None
