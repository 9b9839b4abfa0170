"""The step-engine loop's host time per decode step, on a zero-compute engine.

The engine returns the same fixed logits row for every sequence (a FAKE engine: it measures lmdock's
loop, not a model), so everything timed is lmdock's own work: scheduling, sampling, stop checks,
detokenization, output delivery.  Batch 1, 8, 64 and 256; greedy, and top-p with penalties.  Each
request asks for TOKENS tokens with EOS ignored, all submitted at once, so every step after the first
few decodes the whole batch.

Prints microseconds per step and per sequence per step (the fit of per-step time = a + b * batch), as
wall time and as the CPU time of the loop's thread (what a busy machine does not inflate).  "greedy,
token ids" skips detokenization (``detokenize=False``); "greedy" includes incremental detokenization
with a cheap pure-Python tokenizer (two decodes of a short window per token, as vLLM does).
Targets (issue: the loop at engine speed): a <= 30 us, b <= 3 us, greedy.

``--compute-us N``: the engine's step sleeps N us (outside the GIL, using no CPU: an accelerator's
forward as the host sees it) and the runs are made with ``[scheduler] async_output`` off and on.
Printed: wall time per step, the time the step spent in the engine, and the difference: host time
left on the critical path (with async_output, detokenization and delivery run beside the step).
``--vocab 512,151936``: the logits' width (real models: Llama 3 128,256, Qwen 2.5/3 151,936, Gemma 3
262,144; the row is normal(0, 2), as at 512).  For each vocabulary past 512 the script also prints the
sampler alone against transformers' own processors on the same logits (``--vs-transformers``, on by
default when torch and transformers are installed): repetition penalty 1.1, temperature 0.8, top-p 0.9
and ``torch.multinomial`` (transformers has no presence penalty; lmdock's row adds presence 0.2), as
process CPU time per sequence per step over interleaved rounds, and their ratio.
Run: ``python benchmarks/engine_overhead.py [--tokens 128] [--repeat 3] [--compute-us 1000] [--vocab 512,151936]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


class CharTokenizer:
    """A tokenizer of 512 single-character pieces (cheap, so the numbers are the loop's own)."""

    bos_token_id, eos_token_id, chat_template = 1, 2, None
    pieces = ["<unk>", "<s>", "</s>"] + [chr(0x41 + i) for i in range(509)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [3 + (ord(c) % 509) for c in text]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[t % 512] for t in ids if not (skip_special_tokens and t < 3))


class ZeroComputeEngine:
    """A FAKE step engine: fixed logits, no KV state beyond a set of live ids."""

    def __init__(self, compute_s: float = 0.0, vocab: int = 512) -> None:
        import numpy as np

        self.compute_s = compute_s
        self.in_step = 0.0  # seconds spent inside step()

        self.tokenizer = CharTokenizer()
        self.vocab_size = vocab
        self.max_seq_len = 4096
        self.eos_token_ids = (2,)
        self.generation_config: dict[str, Any] = {}
        self.kv_capacity_tokens = None
        rng = np.random.default_rng(0)
        self.row = rng.normal(0, 2, self.vocab_size).astype(np.float32)
        self.rows = np.broadcast_to(self.row, (1024, vocab))  # read-only: the core copies what it changes
        self.live: set[int] = set()

    def step(self, chunks: Any) -> Any:
        from lmdock.backend import StepOutput

        if self.compute_s:
            t0 = time.perf_counter()
            time.sleep(self.compute_s)
            self.in_step += time.perf_counter() - t0
        for c in chunks:
            self.live.add(c.seq_id)
        return StepOutput(self.rows[: len(chunks)], {c.seq_id: self.rows[: len(c.token_ids)] for c in chunks if c.all_logits})

    def release(self, seq_id: int) -> None:
        self.live.discard(seq_id)

    def fork(self, src: int, dst: int, length: int) -> bool:
        self.live.add(dst)
        return True

    def num_sequences(self) -> int:
        return len(self.live)

    def close(self) -> None:
        pass


def measure(batch: int, tokens: int, params: Any, compute_s: float = 0.0, async_output: bool = False, vocab: int = 512) -> tuple[float, float, float]:
    """Seconds per decode step for ``batch`` concurrent requests of ``tokens`` tokens each: wall time,
    the CPU time of the loop's thread (which a busy machine does not inflate), and the time spent
    in the engine's step."""
    from lmdock._config.model import SchedulerConfig
    from lmdock._engine.runner import StepRunner
    from lmdock._engine.sampler import ReferenceSampler
    from lmdock._engine.scheduler import FcfsScheduler
    from lmdock._llm.streams import RequestFuture
    from lmdock.backend import EngineRequest

    engine = ZeroComputeEngine(compute_s, vocab)
    cpu: list[float] = []
    loop = StepRunner._loop

    def timed_loop(self: Any) -> None:
        t0 = time.thread_time()
        try:
            loop(self)
        finally:
            cpu.append(time.thread_time() - t0)

    StepRunner._loop = timed_loop  # type: ignore[method-assign]
    runner = StepRunner(engine, FcfsScheduler(SchedulerConfig(max_num_seqs=max(batch, 1)), 4096, None), ReferenceSampler(),
                        async_output=async_output)
    try:
        prompt = [1] + [3 + (i % 500) for i in range(15)]
        futures = []
        start = time.perf_counter()
        for i in range(batch):
            fut = RequestFuture(f"r{i}", runner.abort)
            runner.submit(EngineRequest(f"r{i}", None, prompt, params.replace(seed=i)), fut)
            futures.append(fut)
        for fut in futures:
            fut.result()
        elapsed = time.perf_counter() - start
    finally:
        runner.close()
        StepRunner._loop = loop  # type: ignore[method-assign]
    # one prefill step, then decode steps: per generated token
    return elapsed / tokens, cpu[0] / tokens, engine.in_step / tokens


def sampler_vs_transformers(batch: int, vocab: int, rounds: int, steps: int = 16) -> tuple[float, float]:
    """Process CPU seconds per sequence per step: lmdock's sampler alone (top-p 0.9, temperature 0.8,
    repetition 1.1, presence 0.2) and transformers' processors (repetition 1.1, temperature 0.8, top-p
    0.9, multinomial) on the same logits, in interleaved rounds; the best round of each."""
    import numpy as np
    import torch
    from lmdock import SamplingParams
    from lmdock._engine.sampler import ReferenceSampler, SampleRow
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.tile(np.random.default_rng(0).normal(0, 2, vocab).astype(np.float32), (batch, 1))
    prompt = [1] + [3 + (i % 500) for i in range(15)]
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2)
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)])
    ours, theirs = [], []
    for r in range(rounds):
        rows = [SampleRow(params.replace(seed=i), list(prompt), len(prompt), np.random.default_rng(r * 1000 + i)) for i in range(batch)]
        sampler = ReferenceSampler()
        t0 = time.process_time()
        for _ in range(steps):
            for row, s in zip(rows, sampler.sample(logits, rows)):
                row.token_ids.append(s.token)
        ours.append((time.process_time() - t0) / steps / batch)
        ids = torch.tensor([prompt] * batch)
        gen = torch.Generator().manual_seed(r)
        t0 = time.process_time()
        with torch.inference_mode():
            for _ in range(steps):
                scores = procs(ids, torch.from_numpy(logits).clone())  # transformers' processors work in place too
                nxt = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen)
                ids = torch.cat([ids, nxt], dim=1)
        theirs.append((time.process_time() - t0) / steps / batch)
    return min(ours), min(theirs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--vocab", default="512", help="comma-separated vocabulary sizes, e.g. 512,128256,151936,262144")
    ap.add_argument("--compute-us", type=float, default=0.0, help="the engine step sleeps this long (an accelerator's forward)")
    ap.add_argument("--vs-transformers", choices=("auto", "on", "off"), default="auto",
                    help="the sampler alone against transformers' processors, for each vocabulary past 512")
    args = ap.parse_args()

    from lmdock import SamplingParams

    settings = {
        "greedy, token ids": SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True, detokenize=False),
        "greedy": SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True),
        "top-p + penalties": SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2,
                                            max_new_tokens=args.tokens, ignore_eos=True),
    }
    batches = [int(b) for b in args.batches.split(",")]
    vocabs = [int(v) for v in args.vocab.split(",")]
    if args.compute_us:
        print(f"step engine that waits {args.compute_us:.0f} us per step outside the GIL, {args.tokens} tokens per request, best of {args.repeat}")
        print(f"{'sampling':<20} {'batch':>6} {'async_output':>13} {'wall us/step':>13} {'in engine':>10} {'host on critical path':>22}")
        for name, params in settings.items():
            for b in batches:
                for on in (False, True):
                    runs = [measure(b, args.tokens, params, args.compute_us / 1e6, on, vocabs[0]) for _ in range(args.repeat)]
                    wall, _, eng = min(runs, key=lambda r: r[0] - r[2])
                    print(f"{name:<20} {b:>6} {'on' if on else 'off':>13} {wall * 1e6:>13.1f} {eng * 1e6:>10.1f} {(wall - eng) * 1e6:>22.1f}")
        return
    for vocab in vocabs:
        loop_rows(settings, batches, vocab, args)
        if vocab > 512 and _vs_transformers(args.vs_transformers):
            print(f"sampler alone vs transformers' processors, vocab {vocab:,}: process CPU us per sequence per step, best of {args.repeat} interleaved rounds")
            print(f"{'batch':>6} {'lmdock':>10} {'transformers':>13} {'ratio':>7}")
            for b in batches:
                ours, theirs = sampler_vs_transformers(b, vocab, args.repeat)
                print(f"{b:>6} {ours * 1e6:>10.1f} {theirs * 1e6:>13.1f} {ours / theirs:>7.3f}")


def _vs_transformers(mode: str) -> bool:
    import importlib.util

    have = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    if mode == "on" and not have:
        raise SystemExit("--vs-transformers on: torch and transformers are not installed")
    return have and mode != "off"


def loop_rows(settings: dict[str, Any], batches: list[int], vocab: int, args: Any) -> None:
    print(f"zero-compute step engine, vocab {vocab:,}, {args.tokens} tokens per request, best of {args.repeat}")
    print(f"{'sampling':<20} {'batch':>6} {'wall us/step':>13} {'loop CPU us/step':>17} {'CPU us/seq/step':>16}")
    for name, params in settings.items():
        points = []
        for b in batches:
            runs = [measure(b, args.tokens, params, vocab=vocab) for _ in range(args.repeat)]
            wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
            points.append((b, cpu * 1e6))
            print(f"{name:<20} {b:>6} {wall * 1e6:>13.1f} {cpu * 1e6:>17.1f} {cpu * 1e6 / b:>16.2f}")
        # least-squares fit of per-step time = a + b * batch
        n = len(points)
        mx = sum(p[0] for p in points) / n
        my = sum(p[1] for p in points) / n
        slope = sum((x - mx) * (y - my) for x, y in points) / max(1e-9, sum((x - mx) ** 2 for x, _ in points))
        print(f"{name:<20} fit (loop CPU): {my - slope * mx:.1f} us per step + {slope:.2f} us per sequence per step")


if __name__ == "__main__":
    main()
