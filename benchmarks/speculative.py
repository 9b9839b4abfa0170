"""Speculative decoding (n-gram / prompt lookup) on lmdock-hf, against itself and transformers.

Workloads, all greedy, on stories260K (float32, CPU, one thread: the issue's setting):

* ``edit``: batch 1; each prompt holds a 60-token story the model wrote, then its first 12 tokens
  again, so the continuation repeats text already in the context (an edit, an agent loop);
* ``prose``: batch 1; a short opening and nothing to look up but what the model itself writes;
* ``batch8`` / ``batch32``: that many requests at once, half edit-like and half prose.

Systems, timed in interleaved rounds (every system once per round, the order rotating) and reported
as the median over rounds, in process CPU time (every system runs on one thread, one at a time: on a
shared machine CPU time is what the work costs, where wall time also counts the other tenants; the
wall-clock ratio is printed beside it): lmdock-hf without speculation (``off``), with ``speculative_config =
{"method": "ngram", ...}`` (``on``); for batch 1 also transformers' own ``generate`` plain and with
``prompt_lookup_num_tokens=10`` (its prompt lookup, batch 1 only).  Printed: each time, the ratios
``off / on`` (speed-up; the targets: >= 1.5 on edit, >= 0.95 on prose and batches) and ``on`` against
transformers' prompt lookup, the acceptance rate and mean accepted length, and whether the outputs
are identical to ``off``.

``--backend onnx`` / ``mlx`` / ``llamacpp`` (each in an environment with that plugin; no torch
needed) runs the same workloads on that step engine, on and off only: the stories of the edit
prompts are then written by the backend itself (greedy, speculation off), and the engine runs on one
thread where its plugin has the option (onnx ``intra_op_num_threads``, llama.cpp ``n_threads``;
MLX picks its own).

Run: ``HF_HUB_OFFLINE=1 LMDOCK_MODELS=../shared/models python benchmarks/speculative.py [--rounds 5] [--backend hf]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# benchmarks/mlx.py would shadow the mlx namespace package (--backend mlx): keep this folder off the
# path and load the shared helpers by file, as benchmarks/mlx.py does
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _common() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_common", _HERE / "_common.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module

OPENINGS = ["Once upon a time", "One day, a little", "Tom and Sue went", "The sun was", "Lily had a big",
            "There was a dog", "Ben liked to", "Mom said"]


#: the step engines besides lmdock-hf: where each finds stories260K, and its one-thread option
BACKENDS = {
    "onnx": ("stories260K", {"intra_op_num_threads": 1, "inter_op_num_threads": 1}),
    "mlx": ("stories260K", {}),
    "llamacpp": ("stories260K-gguf/stories260K.gguf", {"n_threads": 1, "n_threads_batch": 1}),
}


def workloads(tok: Any, hf_model: Any, tokens: int) -> dict[str, list[list[int]]]:
    """Edit-like prompts (a story and its first words again) and prose prompts (an opening)."""
    import torch

    prose = [tok(o).input_ids for o in OPENINGS]
    stories = [hf_model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False)[0].tolist()[len(ids):] for ids in prose]
    return mix(prose, stories)


def mix(prose: list[list[int]], stories: list[list[int]]) -> dict[str, list[list[int]]]:
    """The workloads from the openings and the stories the model wrote after them (the edit prompt:
    BOS, the story, its first 12 tokens again)."""
    edit = [ids[:1] + story + story[:12] for ids, story in zip(prose, stories)]
    mixed = [p for pair in zip(edit, prose) for p in pair]
    return {"edit": edit, "prose": prose, "batch8": mixed[:8], "batch32": (mixed * 4)[:32]}


def engine_workloads(llm: Any) -> dict[str, list[list[int]]]:
    """The same workloads with the stories written by an lmdock engine (greedy, speculation off)."""
    from lmdock import SamplingParams

    tok = llm.get_tokenizer()
    prose = [tok.encode(o) for o in OPENINGS]
    outs = llm.generate(prose, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    return mix(prose, [list(o.outputs[0].token_ids) for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--only", default="edit,prose,batch8,batch32")
    ap.add_argument("--backend", default="hf", choices=["hf", *BACKENDS])
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if args.backend == "hf":
        off, on, loads, run_hf = setup_hf(args, spec)
    else:
        off, on, loads = setup_engine(args.backend, spec)
        run_hf = None
    print(f"stories260K on lmdock-{args.backend}, greedy, {args.tokens} new tokens, k={args.k}, prompt_lookup 2..4; "
          f"median of {args.rounds} interleaved rounds")
    from lmdock import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run_llm(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
        if len(prompts) == 1 or prompts is loads["edit"] or prompts is loads["prose"]:
            return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]  # batch 1
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    for name in args.only.split(","):
        prompts = loads[name]
        systems = {"off": lambda p=prompts: run_llm(off, p), "on": lambda p=prompts: run_llm(on, p)}
        if run_hf is not None and name in ("edit", "prose"):
            systems["hf"] = lambda p=prompts: run_hf(p, None)
            systems["hf-lookup"] = lambda p=prompts: run_hf(p, 10)
        times: dict[str, list[float]] = {s: [] for s in systems}
        walls: dict[str, list[float]] = {s: [] for s in systems}
        outputs: dict[str, Any] = {}
        before = on.engine.stats()
        order = list(systems)
        for r in range(args.rounds + 1):  # round 0 warms up
            for s in order[r % len(order):] + order[: r % len(order)]:
                start, cpu = time.perf_counter(), time.process_time()
                outputs[s] = systems[s]()
                if r:
                    times[s].append(time.process_time() - cpu)
                    walls[s].append(time.perf_counter() - start)
        after = on.engine.stats()
        med = {s: statistics.median(t) for s, t in times.items()}
        wall = {s: statistics.median(t) for s, t in walls.items()}
        drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        rows = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        line = (f"{name:8s} off {med['off']*1e3:7.1f} ms  on {med['on']*1e3:7.1f} ms  speed-up {med['off']/med['on']:5.2f}x"
                f" (wall {wall['off']/wall['on']:4.2f}x)"
                f"  acceptance {accepted / drafts if drafts else 0:.2f}  mean accepted length {1 + accepted / rows if rows else 0:.2f}"
                f"  identical {outputs['on'] == outputs['off']}")
        if "hf" in med:
            line += (f"\n{'':8s} transformers generate {med['hf']*1e3:7.1f} ms, prompt lookup {med['hf-lookup']*1e3:7.1f} ms"
                     f" ({med['hf']/med['hf-lookup']:.2f}x);  lmdock on vs transformers' prompt lookup {med['hf-lookup']/med['on']:.2f}x"
                     f"  (lmdock off vs plain generate {med['hf']/med['off']:.2f}x)")
        print(line, flush=True)
    off.shutdown()
    on.shutdown()


def setup_hf(args: Any, spec: dict[str, Any]) -> tuple[Any, Any, dict[str, list[list[int]]], Any]:
    """lmdock-hf off and on, the workloads written by transformers, and transformers' generate."""
    import torch
    from lmdock import LLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    common = _common()
    path = str(common.models_dir() / "stories260K")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loads = workloads(tok, hf, args.tokens)
    opts = {"backend": "hf", "backends": {"hf": {"num_threads": 1}}, "kv_cache": {"enable_prefix_caching": False}}
    off = LLM(path, **opts)
    on = LLM(path, speculative_config=spec, **opts)
    print(common.machine())

    def run_hf(prompts: list[list[int]], lookup: int | None) -> list[list[int]]:
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        out = []
        with torch.inference_mode():
            for p in prompts:
                g = hf.generate(torch.tensor([p]), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                do_sample=False, **extra)[0].tolist()
                out.append(g[len(p):])
        return out

    return off, on, loads, run_hf


def setup_engine(backend: str, spec: dict[str, Any]) -> tuple[Any, Any, dict[str, list[list[int]]]]:
    """Another step engine off and on (``BACKENDS``), and the workloads it writes itself."""
    import lmdock
    from lmdock import LLM

    where, threads = BACKENDS[backend]
    path = str(_common().models_dir() / where)
    opts = {"backend": backend, "backends": {backend: threads}, "kv_cache": {"enable_prefix_caching": False}}
    off = LLM(path, **opts)
    on = LLM(path, speculative_config=spec, **opts)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, lmdock {lmdock.__version__}, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")
    return off, on, engine_workloads(off)


if __name__ == "__main__":
    main()
