"""lmdock-onnx against onnxruntime-genai and a plain onnxruntime loop, on the same model, in one run.

Sides, each in its own subprocess, each with ONNX Runtime's default threads:
* lmdock-onnx: ``LLM.generate`` on the model (exported by lmdock-onnx, float32, cached), and
  ``LLM.generate`` on onnxruntime-genai's build of it (a folder lmdock-onnx loads as it is);
* onnxruntime-genai: its model builder's float32 CPU build of the same checkpoint (cached under
  ``~/.cache/lmdock/bench``), ``Generator.generate_next_token`` in a loop;
* plain onnxruntime: a Python loop over lmdock's exported graph with ``InferenceSession.run``,
  argmax, and the KV cache grown by concatenation (what a first hand-written loop does).
Workloads: batch 1 and batch 8 (the same prompt eight times, so no side pads), greedy, EOS ignored,
128 new tokens per sequence, prefill included; best of 3 timed runs after one warm-up.  Each twice:
"text" (lmdock's default, incremental detokenization; onnxruntime-genai decodes each new token with
a ``TokenizerStream`` per sequence, as its examples do) and "token ids" (lmdock with
``detokenize=False``; onnxruntime-genai without decoding; the plain loop never decodes).
Models: stories260K-hd32 (stories260K with head size 32, exactly equivalent: onnxruntime-genai's
GroupQueryAttention needs head sizes that are multiples of 16) from ``LMDOCK_MODELS``, and a
random-weight Llama of about 100M parameters (``benchmarks/_common.py``).
Run: ``HF_HUB_OFFLINE=1 python benchmarks/onnx.py [--tokens 128] [--stories-only]``
(needs lmdock-onnx[export], onnxruntime-genai and onnx-ir).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# This file is named like the package it measures: keep its folder off sys.path so that
# ``import onnx`` finds onnx, and load the shared helpers by file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

PROMPT = "Once upon a time"
BATCHES = (1, 8)


def _common():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_common", _HERE / "_common.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def genai_build(model: Path) -> Path:
    """onnxruntime-genai's model builder output for ``model`` (fp32, CPU), built once."""
    out = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench")) / f"genai-fp32-{model.name}"
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model), "-m", str(model), "-o", str(tmp), "-p", "fp32", "-e", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"onnxruntime-genai's model builder failed on {model}:\n{proc.stderr[-3000:]}")
    tmp.rename(out)
    return out


def worker(side: str, model: str, tokens: int) -> dict[str, float | str]:
    """Load one side, time every batch size; returns tokens/s by batch size."""
    t0 = time.perf_counter()
    if side == "lmdock":
        import lmdock

        llm = lmdock.LLM(model, backend="onnx", build={"dtype": "float32"})
        extra = {"folder": str(llm.engine.engine.folder)}

        def run(batch: int, text: bool) -> int:
            params = lmdock.SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True, detokenize=text)
            outs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
    elif side == "genai":
        import onnxruntime_genai as og

        og_model = og.Model(model)
        og_tokenizer = og.Tokenizer(og_model)
        ids = og_tokenizer.encode(PROMPT)
        extra = {}

        def run(batch: int, text: bool) -> int:
            params = og.GeneratorParams(og_model)
            params.set_search_options(do_sample=False, batch_size=batch, max_length=len(ids) + tokens, min_length=len(ids) + tokens)
            gen = og.Generator(og_model, params)
            gen.append_tokens([list(ids)] * batch)
            streams = [og_tokenizer.create_stream() for _ in range(batch)] if text else []
            out = [""] * batch
            n = 0  # append_tokens computed the first new token's logits; generate_next_token samples it
            while not gen.is_done():
                gen.generate_next_token()
                n += 1
                if text:
                    for i, token in enumerate(gen.get_next_tokens()):
                        out[i] += streams[i].decode(int(token))
            return n * batch
    else:
        run = _plain_loop(model, tokens)
        extra = {}
    result: dict[str, float | str] = {"start_s": time.perf_counter() - t0, **extra}
    for batch in BATCHES:
        for text in (False, True) if side != "ort" else (False,):
            run(batch, text)  # warm-up
            result[f"batch {batch}{', text' if text else ''}"] = max(_rate(run, batch, text) for _ in range(3))
    return result


def _plain_loop(folder: str, tokens: int):  # type: ignore[no-untyped-def]
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoTokenizer

    session = ort.InferenceSession(str(Path(folder) / "model.onnx"), providers=["CPUExecutionProvider"])
    past_names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    shape = session.get_inputs()[3].shape
    ids = AutoTokenizer.from_pretrained(folder).encode(PROMPT)

    def run(batch: int, text: bool) -> int:  # never decodes
        past = [np.zeros((batch, shape[1], 0, shape[3]), dtype=np.float32) for _ in past_names]
        x = np.array([ids] * batch, dtype=np.int64)
        start = 0
        for _ in range(tokens):
            width = x.shape[1]
            feed = {"input_ids": x, "attention_mask": np.ones((batch, start + width), dtype=np.int64),
                    "position_ids": np.broadcast_to(np.arange(start, start + width), (batch, width)).copy(),
                    **dict(zip(past_names, past))}
            logits, *present = session.run(None, feed)
            past = [np.concatenate([p, n], axis=2) for p, n in zip(past, present)]
            x = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            start += width
        return tokens * batch

    return run


def _rate(run, batch: int, text: bool) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    n = run(batch, text)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stories-only", action="store_true", help="skip the 100M-parameter model")
    ap.add_argument("--worker", choices=["lmdock", "genai", "ort"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model, args.tokens)), flush=True)
        return

    from importlib.metadata import version

    common = _common()
    models = [common.models_dir() / "stories260K-hd32"]
    if not args.stories_only:
        models.append(common.random_llama())
    print(f"# {common.machine()}, onnxruntime {version('onnxruntime')}, onnxruntime-genai {version('onnxruntime-genai')}; "
          f"{args.tokens} new tokens per sequence, greedy, EOS ignored, best of 3\n")
    rows = []
    for model in models:
        built = genai_build(model)
        ours = common.spawn(__file__, "lmdock", model, args.tokens)
        ours_on_built = common.spawn(__file__, "lmdock", built, args.tokens)
        genai = common.spawn(__file__, "genai", built, args.tokens)
        plain = common.spawn(__file__, "ort", ours["folder"], args.tokens)
        for batch in BATCHES:
            for text in (False, True):
                key = f"batch {batch}{', text' if text else ''}"
                o, b, g = (float(side[key]) for side in (ours, ours_on_built, genai))
                p = None if text else float(plain[key])
                rows.append((model.name, f"batch {batch}", "text" if text else "token ids", f"{o:,.0f}",
                             "—" if p is None else f"{p:,.0f}", "—" if p is None else f"{o / p:.2f}x",
                             f"{b:,.0f}", f"{g:,.0f}", f"{b / g:.2f}x"))
    print(common.table(rows, ("model", "decode", "output", "lmdock-onnx, own export", "plain ORT loop, same graph", "ratio",
                              "lmdock-onnx, genai's build", "onnxruntime-genai", "ratio")))
    print("\ntok/s; each ratio compares lmdock-onnx with the other side on the same ONNX graph")


if __name__ == "__main__":
    main()
