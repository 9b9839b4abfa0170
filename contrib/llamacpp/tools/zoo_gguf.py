"""Convert lmdock-conformance's model-family zoo to GGUF files with llama.cpp's own converter, for
test_families on lmdock-llamacpp (``--lmdock-zoo-gguf=OUT``).

Run it in lmdock-llamacpp's environment (it reads the zoo through lmdock-conformance and checks each
file loads in llama.cpp); the converter runs in a Python with torch and transformers (``--python``),
from the llama-cpp-python sdist lmdock-llamacpp builds against::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    python contrib/llamacpp/tools/zoo_gguf.py ZOO OUT --python HF_ENV/bin/python \\
        --converter llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py

``OUT/<family>.gguf`` per family it converts, and ``OUT/gguf.json`` with, for each family it does not,
the reason: the converter's own error line; a file that drops what the checkpoint needs (a sliding
window, a partial rotary dimension: llama.cpp would run a different model, silently); or a file
llama.cpp cannot load (llama.cpp's error line).  Float32 files, two conversions at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

FORMAT = 1
#: converter flags a family needs: the zoo's Qwen3-Next has no multi-token-prediction layers, which the
#: converter otherwise requires
EXTRA_ARGS = {"qwen3_next": ["--no-mtp"]}


def convert(python: str, converter: Path, checkpoint: Path, target: Path, family: str) -> str | None:
    """Run the converter; None on success, else its one-line reason."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(converter.parent / "gguf-py"), os.environ.get("PYTHONPATH")]))}
    cmd = [python, str(converter), str(checkpoint), "--outfile", str(target), "--outtype", "f32", *EXTRA_ARGS.get(family, [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode == 0 and target.is_file():
        return None
    target.unlink(missing_ok=True)
    return f"convert_hf_to_gguf.py fails: {_error_line(proc.stderr) or f'exit status {proc.returncode}'}"


def _error_line(log: str) -> str:
    """The exception line of a Python traceback (``KeyError: 'n_ctx'``), else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return (errors or lines or [""])[-1][:300]


def lost(config: dict[str, Any], gguf: Path) -> str | None:
    """What the checkpoint needs that the GGUF does not hold, or None."""
    from lmdock._plugin.families import config_features, gguf_features, read_gguf_metadata

    want, got = config_features(config), gguf_features(gguf)
    if got is None:
        return "the converter wrote a file lmdock cannot read as GGUF"
    if "sliding_window" in want.features and "sliding_window" not in got.features:
        return (f"convert_hf_to_gguf.py drops the {config.get('sliding_window')}-token sliding window (the file holds none, "
                "so llama.cpp would attend past it)")
    meta = read_gguf_metadata(gguf)
    rope = meta.get(f"{meta.get('general.architecture')}.rope.dimension_count")
    head = config.get("head_dim") or config.get("hidden_size", 0) // max(1, config.get("num_attention_heads", 1))
    factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if isinstance(rope, int) and head and int(head * factor) != rope:
        return (f"convert_hf_to_gguf.py writes a rotary dimension of {rope}; the checkpoint ropes {int(head * factor)} of "
                f"each head's {head} (partial_rotary_factor {factor})")
    return None


def loads(gguf: Path) -> str | None:
    """None when llama.cpp loads the file, else llama.cpp's error line (from its log, in a child)."""
    code = "import llama_cpp, sys; llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=True)"
    proc = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    errors = [ln.split("error loading model:", 1)[1].strip() for ln in proc.stderr.splitlines() if "error loading model:" in ln]
    return f"llama.cpp cannot load the converted file: {(errors or [_error_line(proc.stderr)])[-1][:300]}"


def one(family: str, zoo: Path, out: Path, python: str, converter: Path) -> tuple[str, str | None]:
    target = out / f"{family}.gguf"
    why = convert(python, converter, zoo / family, target, family)
    if why is None:
        why = lost(json.loads((zoo / family / "config.json").read_text()), target) or loads(target)
        if why is not None:
            target.unlink()
    print(f"zoo gguf: {family}: {why or 'converted'}", file=sys.stderr)
    return family, why


def build(zoo: Path, out: Path, python: str, converter: Path, families: list[str] | None = None) -> dict[str, Any]:
    from lmdock_conformance.zoo import read

    names = families or list(read(zoo)["families"])
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(2) as pool:
        results = dict(pool.map(lambda f: one(f, zoo, out, python, converter), names))
    data = {"format": FORMAT, "converter": str(converter), "converted": sorted(f for f, why in results.items() if why is None),
            "not_converted": {f: why for f, why in sorted(results.items()) if why is not None}}
    (out / "gguf.json").write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("zoo", type=Path, help="a built zoo (python -m lmdock_conformance.zoo build ZOO)")
    parser.add_argument("out", type=Path, help="where the GGUF files and gguf.json go")
    parser.add_argument("--converter", type=Path, required=True, help="convert_hf_to_gguf.py from the llama-cpp-python sdist")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch and transformers, for the converter")
    parser.add_argument("--family", action="append", help="only these families (repeatable)")
    args = parser.parse_args(argv)
    if not args.converter.is_file():
        parser.error(f"--converter {args.converter}: no such file (it is vendor/llama.cpp/convert_hf_to_gguf.py in the sdist)")
    data = build(args.zoo, args.out, args.python, args.converter, args.family)
    print(json.dumps({"converted": data["converted"], "not_converted": sorted(data["not_converted"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
