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

Three test-only adaptations, for the zoo's checkpoints only, and never by editing the sdist's files:

- The zoo gives every family one tokenizer: stories260K's SentencePiece tokenizer (``tokenizer.model``,
  ``ZOO_SPM_SHA256``), which no real checkpoint of most families has.  The converter reads it as
  SentencePiece for llama, mistral, qwen2..., but for families whose converter class takes the
  byte-level BPE path (``_set_vocab_gpt2``: falcon_h1, gpt_oss, lfm2, olmo2, qwen3_moe, qwen3_next) it
  stops at the BPE pre-tokenizer check ("BPE pre-tokenizer was not recognized").  The converter runs
  through a wrapper (``python zoo_gguf.py --run-converter CONVERTER ARGS``, in the converter's Python)
  that sends exactly that tokenizer down the converter's own SentencePiece path instead, as it does for
  llama: the GGUF then holds the zoo tokenizer as it is.  The family tests feed token ids, so the
  vocabulary does not enter the tokens they compare; any other tokenizer goes the converter's way.
- llama.cpp gives a file whose general.name holds "phi3" Phi-3's special-token attributes, looking the
  tokens up by text; the zoo tokenizer has no ``<|endoftext|>``, so the zoo's Phi-3 is named otherwise
  (``EXTRA_ARGS``).  Those attributes only steer how text splits around special tokens.
- transformers 5 writes GPT-2's context as ``n_positions`` only; the converter reads ``n_ctx``.  The
  converter gets a copy of the checkpoint (links to its files) whose config.json adds
  ``n_ctx = n_positions`` (``CONFIG_ALIASES``).

``gguf.json`` names the three under ``adapted``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

FORMAT = 1
#: converter flags a family needs: the zoo's Qwen3-Next has no multi-token-prediction layers, which the
#: converter otherwise requires; the zoo's Phi-3 gets a general.name without "phi3" in it, since llama.cpp
#: gives a file so named Phi-3's special-token attributes, by token text, and the zoo tokenizer has no
#: <|endoftext|> ("error loading model vocabulary: unordered_map::at"; attributes that only steer how text
#: is split around special tokens, not the ids the family tests feed)
EXTRA_ARGS = {"qwen3_next": ["--no-mtp"], "phi3": ["--model-name", "lmdock zoo family"]}
#: llama.cpp graphs that renormalise the top-k routing weights whatever the checkpoint says (build_moe_ffn's
#: norm_w is true in src/models/qwen3moe.cpp and qwen3next.cpp; no GGUF key turns it off)
TOPK_RENORMALISED = frozenset({"qwen3moe", "qwen3next"})
#: sha256 of the zoo's tokenizer.model (stories260K's SentencePiece model, shared by every zoo family)
ZOO_SPM_SHA256 = "4e305eb711b2ac0bb8b80ba6ee32e211182f9e40064d054a5dea9b645c951edc"
#: config keys the converter reads under another name than transformers 5 writes: family -> {read: written}
CONFIG_ALIASES = {"gpt2": {"n_ctx": "n_positions"}}
#: what the two adaptations are, for gguf.json
ADAPTED = {
    "tokenizer": "the zoo's SentencePiece tokenizer (tokenizer.model, sha256 " + ZOO_SPM_SHA256[:12] + "...) goes down the "
                 "converter's SentencePiece path where the family's converter class takes the BPE one (test-only: the "
                 "family tests feed token ids)",
    "config": "gpt2: the converter reads a copy of config.json with n_ctx = n_positions (transformers 5 writes no n_ctx)",
    "name": "phi3: --model-name 'lmdock zoo family': llama.cpp sets Phi-3's special-token attributes on a file named phi3, "
            "by token text, and the zoo tokenizer has no <|endoftext|> (unordered_map::at at load)",
}


def convert(python: str, converter: Path, checkpoint: Path, target: Path, family: str) -> str | None:
    """Run the converter (through the wrapper); None on success, else its one-line reason."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(converter.parent / "gguf-py"), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix=f"zoo-gguf-{family}-") as tmp:
        source = _aliased(checkpoint, Path(tmp), CONFIG_ALIASES.get(family, {}))
        cmd = [python, __file__, "--run-converter", str(converter), str(source), "--outfile", str(target), "--outtype", "f32",
               *EXTRA_ARGS.get(family, [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode == 0 and target.is_file():
        return None
    target.unlink(missing_ok=True)
    return f"convert_hf_to_gguf.py fails: {_error_line(proc.stderr) or f'exit status {proc.returncode}'}"


def _aliased(checkpoint: Path, tmp: Path, aliases: dict[str, str]) -> Path:
    """The checkpoint itself, or with aliases a copy in tmp: links to its files, config.json with the keys added."""
    if not aliases:
        return checkpoint
    config = json.loads((checkpoint / "config.json").read_text())
    for read, written in aliases.items():
        config.setdefault(read, config[written])
    for item in checkpoint.iterdir():
        if item.name != "config.json":
            (tmp / item.name).symlink_to(item.resolve())
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    return tmp


def run_converter(converter: Path, argv: list[str]) -> None:
    """Run convert_hf_to_gguf.py in this process, its BPE vocabulary step sending the zoo's SentencePiece
    tokenizer down its SentencePiece step (the module docstring says why); nothing else differs."""
    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    from conversion.base import TextModel  # the sdist's converter package, beside convert_hf_to_gguf.py

    bpe = TextModel._set_vocab_gpt2  # noqa: SLF001

    def set_vocab_gpt2(self: Any) -> None:
        spm = Path(self.dir_model) / "tokenizer.model"
        if spm.is_file() and hashlib.sha256(spm.read_bytes()).hexdigest() == ZOO_SPM_SHA256:
            return self._set_vocab_sentencepiece()  # noqa: SLF001
        return bpe(self)

    TextModel._set_vocab_gpt2 = set_vocab_gpt2  # noqa: SLF001
    sys.argv = [str(converter), *argv]
    runpy.run_path(str(converter), run_name="__main__")


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
    if why := routing_lost(config, str(meta.get("general.architecture"))):
        return why
    ffn = meta.get(f"{meta.get('general.architecture')}.feed_forward_length")
    if isinstance(config.get("n_inner"), int) and isinstance(ffn, int) and ffn != config["n_inner"]:
        return (f"convert_hf_to_gguf.py writes a feed-forward length of {ffn} (4 * n_embd); the checkpoint's n_inner is "
                f"{config['n_inner']}")
    rope = meta.get(f"{meta.get('general.architecture')}.rope.dimension_count")
    head = config.get("head_dim") or config.get("hidden_size", 0) // max(1, config.get("num_attention_heads", 1))
    factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if isinstance(rope, int) and head and int(head * factor) != rope:
        return (f"convert_hf_to_gguf.py writes a rotary dimension of {rope}; the checkpoint ropes {int(head * factor)} of "
                f"each head's {head} (partial_rotary_factor {factor})")
    return None


def routing_lost(config: dict[str, Any], arch: str) -> str | None:
    """A MoE checkpoint that does not renormalise its top-k routing weights, for a llama.cpp graph that does."""
    if arch in TOPK_RENORMALISED and config.get("norm_topk_prob") is False:
        return (f"llama.cpp's {arch} graph renormalises the top-k routing weights; the checkpoint has norm_topk_prob "
                "false (the family tests' Qwen3-MoE on llama.cpp gave transformers' tokens with norm_topk_prob true)")
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
    data = {"format": FORMAT, "converter": str(converter), "adapted": ADAPTED, "converted": sorted(f for f, why in results.items() if why is None),
            "not_converted": {f: why for f, why in sorted(results.items()) if why is not None}}
    (out / "gguf.json").write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-converter"]:  # the wrapper, in the converter's Python (convert above)
        run_converter(Path(argv[1]), argv[2:])
        return 0
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
