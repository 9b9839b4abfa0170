"""lmdock-llamacpp against llama-cpp-python used directly, on the same GGUF files, in one run.

Sides, each in its own subprocess, all with the same llama.cpp settings (threads = physical cores,
unified KV cache of the model's 2048 positions, n_batch 2048, f32 KV for the f32 file and f16 for
q8_0, flash attention left to llama.cpp):
* lmdock-llamacpp: ``LLM.generate`` (the core schedules, samples greedily in NumPy, detokenizes);
* raw loop: llama-cpp-python's low-level API in the pattern of llama.cpp's ``examples/batched``: one
  ``llama_batch`` per step with a sequence id per row, ``llama_decode``, a greedy ``llama_sampler``
  per row (in C);
* ``Llama.generate``: llama-cpp-python's high-level API, greedy (top_k=1), batch 1 only (it runs one
  sequence).
Workloads: batch 1 and batch 8 (the prompt "Once upon a time" eight times), greedy, EOS ignored, 128
new tokens per sequence, prefill included; best of 3 timed runs after one warm-up (``LMDOCK_BENCH_REPEAT``).
Model: the random-weight Llama of about 100M parameters (``benchmarks/_common.py``), converted to GGUF
f32 and q8_0 with the ``convert_hf_to_gguf.py`` vendored in llama-cpp-python's sdist (cached).
Run: ``HF_HUB_OFFLINE=1 python benchmarks/llamacpp.py --convert PATH/convert_hf_to_gguf.py [--tokens 128]``
(building the model needs torch, transformers and the ``gguf`` package; the sides need only
lmdock-llamacpp).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # keep `import llama_cpp` the package

PROMPT = "Once upon a time"
BATCHES = (1, 8)
N_CTX = 2048


def _common():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_common", _HERE / "_common.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def gguf_files(convert: str) -> dict[str, Path]:
    """The random Llama as GGUF f32 and q8_0, converted once."""
    common = _common()
    folder = common.random_llama()
    out = {}
    for kind in ("f32", "q8_0"):
        path = folder.parent / f"{folder.name}-{kind}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(".partial")
            cmd = [sys.executable, convert, str(folder), "--outtype", kind, "--outfile", str(tmp)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"convert_hf_to_gguf.py failed on {folder}:\n{proc.stderr[-3000:]}")
            tmp.rename(path)
        out[kind] = path
    return out


def _kv(model: str) -> str:
    return "f16" if "q8_0" in Path(model).name else "f32"


def _best(run: Any) -> float:
    run()  # warm-up
    return min(_time(run) for _ in range(int(os.environ.get("LMDOCK_BENCH_REPEAT", "3"))))


def _time(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def worker_lmdock(model: str, tokens: int) -> dict[str, Any]:
    from lmdock import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    options = {"n_ctx": N_CTX, "n_batch": N_CTX, "type_k": _kv(model), "type_v": _kv(model)}
    result = {}
    with LLM(model, backend="llamacpp", backends={"llamacpp": options}) as llm:
        for batch in BATCHES:
            seconds = _best(lambda batch=batch: llm.generate([PROMPT] * batch, params, use_tqdm=False))
            result[str(batch)] = batch * tokens / seconds
    return result


def worker_raw(model: str, tokens: int) -> dict[str, Any]:
    import llama_cpp as lc
    from lmdock_llamacpp._engine import physical_cores, set_verbose

    set_verbose(False)
    mp = lc.llama_model_default_params()
    m = lc.llama_model_load_from_file(model.encode(), mp)
    vocab = lc.llama_model_get_vocab(m)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = N_CTX, N_CTX, 512, 8, True
    cp.n_threads = cp.n_threads_batch = physical_cores()
    cp.type_k = cp.type_v = 0 if _kv(model) == "f32" else 1
    cp.no_perf = True
    ctx = lc.llama_init_from_model(m, cp)
    mem = lc.llama_get_memory(ctx)
    text = PROMPT.encode()
    buf = (lc.llama_token * 64)()
    n_prompt = lc.llama_tokenize(vocab, text, len(text), buf, 64, True, True)
    prompt = list(buf[:n_prompt])
    batch = lc.llama_batch_init(N_CTX, 0, 8)

    def run(n_seq: int) -> None:
        lc.llama_memory_clear(mem, True)
        samplers = []
        for _ in range(n_seq):
            s = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
            lc.llama_sampler_chain_add(s, lc.llama_sampler_init_greedy())
            samplers.append(s)
        batch.n_tokens = 0
        for i, t in enumerate(prompt):  # the prompt once, shared by every sequence (examples/batched)
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, n_seq
            for s in range(n_seq):
                batch.seq_id[i][s] = s
            batch.logits[i] = 0
        batch.n_tokens = len(prompt)
        batch.logits[len(prompt) - 1] = 1
        lc.llama_decode(ctx, batch)
        rows = [len(prompt) - 1] * n_seq
        for step in range(tokens):
            new = [lc.llama_sampler_sample(samplers[s], ctx, rows[s]) for s in range(n_seq)]
            if step == tokens - 1:
                break
            for s, t in enumerate(new):
                batch.token[s], batch.pos[s], batch.n_seq_id[s], batch.logits[s] = t, len(prompt) + step, 1, 1
                batch.seq_id[s][0] = s
            batch.n_tokens = n_seq
            rows = list(range(n_seq))
            lc.llama_decode(ctx, batch)
        for s in samplers:
            lc.llama_sampler_free(s)

    result = {str(b): b * tokens / _best(lambda b=b: run(b)) for b in BATCHES}
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(m)
    return result


def worker_highlevel(model: str, tokens: int) -> dict[str, Any]:
    from llama_cpp import Llama
    from lmdock_llamacpp._engine import physical_cores

    kv = 0 if _kv(model) == "f32" else 1
    llm = Llama(model, n_ctx=N_CTX, n_batch=N_CTX, n_threads=physical_cores(), n_threads_batch=physical_cores(),
                type_k=kv, type_v=kv, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())

    def run() -> None:
        llm.reset()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i + 1 == tokens:
                break

    return {"1": tokens / _best(run)}


WORKERS = {"lmdock": worker_lmdock, "raw": worker_raw, "highlevel": worker_highlevel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(WORKERS))
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--convert", help="convert_hf_to_gguf.py from llama-cpp-python's sdist (vendor/llama.cpp)")
    parser.add_argument("--files", nargs="*", help="GGUF files to use instead of converting (q8_0 in the name: the q8_0 one)")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(WORKERS[args.worker](args.model, args.tokens)), flush=True)
        return
    common = _common()
    files = {("q8_0" if "q8_0" in Path(f).name else "f32"): Path(f) for f in args.files} if args.files else gguf_files(args.convert)
    rows = []
    for kind, path in files.items():
        res = {side: common.spawn(__file__, side, path, args.tokens) for side in ("raw", "lmdock", "highlevel")}
        for b in map(str, BATCHES):
            high = res["highlevel"].get(b)
            rows.append((kind, b, f"{res['lmdock'][b]:.1f}", f"{res['raw'][b]:.1f}", f"{high:.1f}" if high else "-",
                         f"{res['lmdock'][b] / res['raw'][b]:.2f}x", f"{res['lmdock'][b] / high:.2f}x" if high else "-"))
    from importlib.metadata import version

    print(f"llama-cpp-python {version('llama-cpp-python')}, {os.cpu_count()} CPUs, {args.tokens} new tokens per sequence, greedy")
    print(common.table(rows, ("GGUF", "batch", "lmdock tok/s", "raw loop tok/s", "Llama.generate tok/s",
                              "lmdock / raw", "lmdock / generate")))


if __name__ == "__main__":
    main()
