"""lmdock-hf offload under a memory limit (FlexLLMGen's promise, on CPU): a model 4x the budget.

Model: a random-weight float32 Llama of ~1 GiB (265M parameters: 24 layers, hidden 1024,
intermediate 2816, 16 query heads and 2 KV heads of 64, vocabulary 512 = stories260K's tokenizer),
built once with a fixed seed and cached under ``$LMDOCK_BENCH_CACHE`` (``~/.cache/lmdock/bench``).
Chosen so that the streaming engine's working set fits the budget at batch 64: thin layers (44 MB
each, so the two layer buffers take 84 MiB) and grouped-query attention, 8 query heads per KV head
(the KV cache of 64 sequences of 8 + 32 tokens is 60 MiB).  Workload: token-id prompts of 8 tokens
and 32 greedy new tokens (``ignore_eos``) at batch 1 and batch 64; FlexLLMGen's benchmarks also
generate 32 tokens, from 512-token prompts on a GPU, which here would not leave the KV cache room.
One untimed warm-up generate comes first, so each row is steady state.

Each configuration runs in a child process of its own, in a cgroup v1 memory group made for that run
(a child of this process's memory cgroup; page cache included; this machine has no swap).  The
offload rows and the incumbent run under the limit; the in-memory baseline holds the whole model in
RAM, so its group has no limit (it is there to measure its peak the same way).  Page caches are
dropped before every run.  Rows:

- ``lmdock-hf in memory``: the reference for greedy tokens and for the batch-64 throughput ratio.
- ``lmdock-hf offload``: ``[offload]`` with every decoder layer on disk (``weights_gpu_percent =
  weights_cpu_percent = 0``), prefetch on, the KV cache in RAM; lmdock's on-disk layout is converted
  beforehand, outside the limit, and not timed.
- ``... compress_weight``: the same with group-wise 4-bit weights on disk.
- ``... memory_budget_gib``: ``[offload] memory_budget_gib`` = the 256 MiB above the interpreter
  (``--budget-mib``), and lmdock's cost model picks the placement: it pays for the resident
  embeddings and head, two layer buffers and the KV cache of batch 64, and keeps as many whole
  decoder layers in RAM as the rest holds (2 of 24 here, 84 MiB), streaming the others.
- ``transformers + accelerate``: ``from_pretrained(device_map={... decoder layers: "disk"},
  offload_folder=...)`` (accelerate reads a safetensors checkpoint in place, through the page cache)
  and ``generate(do_sample=False)``; skipped, and said so, when accelerate is not installed.

The disk-bandwidth bound at batch 1 is the bytes a step streams (the layout's, or the checkpoint's
decoder layers for accelerate) divided by the read bandwidth measured right before that row
(the layout's files read by the engine's own ``O_DIRECT`` reader, 4 threads of 4 MiB requests, the
best of 3 passes: a VM disk is not steady).

The budget: Python + torch + transformers + lmdock hold ~340 MiB before any weight exists (~255 MiB
anonymous, ~85 MiB of mapped library code), so a bare 256 MiB limit does not even get through the
imports (the first row shows it: the child thrashes on its library pages until it is killed or times
out).  The limit is therefore that floor, measured here (the resident set of a child that imported
all of it and loaded the tokenizer), plus ``--budget-mib`` (256): the weights, layer buffers, KV
cache, activations and the page cache of what the run reads share 256 MiB on top of the interpreter.
``--limit-mib`` sets the limit outright instead.  A library file that a process outside the group
keeps mapped stays in the page cache uncharged, so run this from a venv of its own; the parent
process imports no torch for the same reason.  The "others' CPU" column is the CPU time every other
process on the machine used during the run: with 2 torch threads on 2 cores, a neighbour's load
slows a CPU-bound row several-fold, so a row during which they used more than ``--max-others`` (0.3
cores) is run once more (``--retries``), and the numbers are only comparable when it is ~0.

Needs root (cgroup v1 at /sys/fs/cgroup/memory, /proc/sys/vm/drop_caches); without a cgroup it runs
unlimited and says so.  8-11 minutes on 2 cores (the first run also builds the model):
``HF_HUB_OFFLINE=1 LMDOCK_MODELS=/path/to/models python benchmarks/offload.py``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: ~1 GiB of float32: thin layers (two buffers fit the budget), GQA 16/2 (the KV cache of batch 64 fits).
SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
OFFLOAD = {"weights_gpu_percent": 0, "weights_cpu_percent": 0}
MiB = 2**20


def _common() -> Any:
    """benchmarks/_common.py, loaded by path: this folder is not on sys.path (see the bottom)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_common", Path(__file__).with_name("_common.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_folder(seed: int = 0) -> Path:
    cache = Path(os.environ.get("LMDOCK_BENCH_CACHE", Path.home() / ".cache" / "lmdock" / "bench"))
    return cache / f"llama-1g-fp32-seed{seed}"


def workload(batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(prompt_len - 1)] for _ in range(batch)]


def read_bytes() -> int:
    """Bytes this process (all its threads) caused to be read from storage, from /proc/self/io."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def rss_mib(field: str) -> float:
    """A resident-set field of /proc/self/status (RssAnon, RssFile, RssShmem, VmRSS) in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def private_mib() -> float:
    return rss_mib("RssAnon") + rss_mib("RssShmem")


_peak_anon = [0.0]


def watch_anon(period: float = 0.02) -> None:
    """Sample the process's unreclaimable memory (anonymous + shared anonymous, e.g. the offload
    engine's layer buffers, which are ``mmap(-1)``) in a thread: the cgroup's peak includes page
    cache that the kernel reclaims under the limit, this does not (no swap here)."""
    import threading

    def run() -> None:
        while True:
            _peak_anon[0] = max(_peak_anon[0], private_mib())
            time.sleep(period)

    threading.Thread(target=run, daemon=True).start()


def phase(**fields: Any) -> None:
    fields["private_peak_mib"] = max(_peak_anon[0], private_mib())
    print("PHASE " + json.dumps(fields), flush=True)


# -------------------------------------------------------------------------------------------------
# workers (each in a process of its own)
# -------------------------------------------------------------------------------------------------


def prepare_worker(args: argparse.Namespace) -> None:
    """Outside the limit: build the model (once) and convert both offload layouts (once)."""
    folder = model_folder()
    if not (folder / "model.safetensors").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        tmp = folder.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        LlamaForCausalLM(LlamaConfig(**SHAPE)).eval().save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(_common().models_dir() / "stories260K" / name, tmp / name)
        tmp.rename(folder)
    from lmdock import LLM

    layouts = {}
    for compress in (False, True):
        with LLM(str(folder), backend="hf", build={"dtype": "float32", "max_seq_len": args.prompt_len + args.tokens},
                 offload={**OFFLOAD, "compress_weight": compress}) as llm:
            lay = llm._engine.engine.layout
            layouts["compress" if compress else "plain"] = {"folder": str(lay.folder), "num_layers": lay.num_layers, "layer_bytes": lay.layer_bytes}
    phase(name="prepare", model=str(folder), model_bytes=(folder / "model.safetensors").stat().st_size, layouts=layouts)


def floor_worker(args: argparse.Namespace) -> None:
    """What the process takes before any weight: the imports and the tokenizer."""
    import lmdock  # noqa: F401
    import lmdock_hf._offload  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: F401

    AutoTokenizer.from_pretrained(str(model_folder()))
    phase(name="floor", rss_mib=rss_mib("VmRSS"), rss_anon_mib=rss_mib("RssAnon"), rss_file_mib=rss_mib("RssFile"))


def lmdock_worker(args: argparse.Namespace, mode: str) -> None:
    from lmdock import LLM, SamplingParams

    kwargs: dict[str, Any] = {"build": {"dtype": "float32", "max_seq_len": args.prompt_len + args.tokens},
                              "scheduler": {"max_num_seqs": args.batch}}
    if mode == "budget":  # lmdock's cost model places the layers within the budget above the interpreter
        kwargs["offload"] = {"memory_budget_gib": args.budget_mib / 1024}
    elif mode != "memory":
        kwargs["offload"] = {**OFFLOAD, "compress_weight": mode == "compress"}
    t0, io0 = time.perf_counter(), read_bytes()
    llm = LLM(str(model_folder()), backend="hf", **kwargs)
    engine = llm._engine.engine
    streamed = len(engine.streamed) * engine.layout.layer_bytes if mode != "memory" else 0
    phase(name="load", seconds=time.perf_counter() - t0, read_bytes=read_bytes() - io0, plan=getattr(engine, "offload_plan", None),
          streamed_bytes=streamed)
    llm.generate(workload(2, args.prompt_len, seed=1), SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True, detokenize=False))
    params = SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True, detokenize=False)
    for batch in (1, args.batch):
        prompts = workload(args.batch, args.prompt_len)[:batch]
        before = engine.stats() if mode != "memory" else {}
        io0, t0 = read_bytes(), time.perf_counter()
        out = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        io = read_bytes() - io0
        stats = {}
        if mode != "memory":
            after = engine.stats()
            stats = {k: after[k] - before[k] for k in ("bytes_read", "read_seconds", "wait_seconds")} | {"o_direct": after["o_direct"]}
        tokens = [list(o.outputs[0].token_ids) for o in out]
        phase(name=f"batch{batch}", batch=batch, seconds=dt, tok_s=sum(map(len, tokens)) / dt, read_bytes=io,
              tokens=tokens, engine=stats, private_mib=private_mib())
    llm.shutdown()


def accelerate_worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    folder = model_folder()
    n = SHAPE["num_hidden_layers"]
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "disk" for i in range(n)}
    t0, io0 = time.perf_counter(), read_bytes()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, device_map=device_map, offload_folder=args.offload_folder).eval()
    phase(name="load", seconds=time.perf_counter() - t0, read_bytes=read_bytes() - io0, plan="accelerate device_map: every decoder layer on disk")

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    generate(workload(2, args.prompt_len, seed=1), 2)
    for batch in (1, args.batch):
        prompts = workload(args.batch, args.prompt_len)[:batch]
        io0, t0 = read_bytes(), time.perf_counter()
        tokens = generate(prompts, args.tokens)
        dt = time.perf_counter() - t0
        phase(name=f"batch{batch}", batch=batch, seconds=dt, tok_s=sum(map(len, tokens)) / dt, read_bytes=read_bytes() - io0,
              tokens=tokens, engine={}, private_mib=private_mib())


# -------------------------------------------------------------------------------------------------
# the parent: cgroups, page cache, bandwidth, children, table (no torch here: its library pages
# would stay cached, charged to this process, and a child would get them for free)
# -------------------------------------------------------------------------------------------------


def memory_cgroup_root() -> Path | None:
    """This process's cgroup v1 memory group, if there is one we can make children in."""
    base = Path("/sys/fs/cgroup/memory")
    if not (base / "memory.limit_in_bytes").is_file():
        return None
    rel = ""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                rel = path.lstrip("/")
    here = base / rel
    return here if os.access(here, os.W_OK) else None


class Group:
    """A fresh cgroup v1 memory group for one child (``limit`` bytes, or none)."""

    def __init__(self, root: Path, name: str, limit: int | None) -> None:
        self.path = root / f"lmdock-offload-bench-{os.getpid()}-{name}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit) if limit else "-1")

    def read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return -1

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_caches(files: list[Path]) -> str:
    for f in files:  # works without root too
        try:
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError:
            pass
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return "drop_caches"
    except OSError:
        return "fadvise"


def read_bandwidth(folder: Path, passes: int = 3) -> tuple[float, list[float]]:
    """Every layer file of a layout read into one aligned buffer by the offload engine's own reader
    (``lmdock_hf._direct``: O_DIRECT, 4 threads of 4 MiB requests; it imports no torch): the best
    and all passes (B/s)."""
    from lmdock_hf._direct import DirectReader

    files = sorted(folder.glob("layer_*.bin"))
    size = max(f.stat().st_size for f in files)
    buf = mmap.mmap(-1, (size + 4095) // 4096 * 4096)
    reader = DirectReader()
    rates = []
    try:
        for _ in range(passes):
            total, t0 = 0, time.perf_counter()
            for f in files:
                total += reader.read(str(f), memoryview(buf)[: f.stat().st_size])
            rates.append(total / (time.perf_counter() - t0))
    finally:
        reader.close()
    return max(rates), rates


def cpu_busy_seconds() -> float:
    """CPU seconds spent by every process on the machine so far (from /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_child(args: argparse.Namespace, worker: str, *, root: Path | None, limit: int | None, timeout: float,
              files: list[Path], extra: list[str] = ()) -> dict[str, Any]:
    """Run ``--worker`` in a fresh memory group; collect its PHASE lines and what the group saw."""
    drop_caches(files)
    group = Group(root, worker, limit) if root else None
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--batch", str(args.batch),
           "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens), "--budget-mib", str(args.budget_mib), *extra]
    procs = str(group.path / "cgroup.procs") if group else None

    def enter() -> None:
        if procs:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

    result: dict[str, Any] = {"phases": {}}
    busy0, mine0, t0 = cpu_busy_seconds(), children_cpu_seconds(), time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, preexec_fn=enter, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            result["timed_out"] = timeout
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    result["wall"] = time.perf_counter() - t0
    mine = children_cpu_seconds() - mine0
    result["cpu_self"] = mine / result["wall"]  # cores this run used, on average
    result["cpu_others"] = max(0.0, cpu_busy_seconds() - busy0 - mine) / result["wall"]  # cores everything else used
    result["returncode"] = proc.returncode
    for line in stdout.splitlines():
        if line.startswith("PHASE "):
            p = json.loads(line[len("PHASE "):])
            result["phases"][p["name"]] = p
    if proc.returncode != 0 and "timed_out" not in result:
        result["stderr"] = stderr[-1500:]
    if group:
        result["peak"] = group.read("memory.max_usage_in_bytes")
        result["failcnt"] = group.read("memory.failcnt")
        result["oom_kills"] = group.oom_kills()
        result["limit"] = limit
        group.remove()
    return result


def outcome(r: dict[str, Any]) -> str:
    if r.get("timed_out"):
        return f"timed out after {r['timed_out']:.0f} s"
    if r["returncode"] == -signal.SIGKILL:
        return f"killed (SIGKILL{', OOM' if r.get('oom_kills', 0) > 0 else ''}) after {r['wall']:.0f} s"
    if r["returncode"] != 0:
        return f"failed (exit {r['returncode']})"
    return "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=int, default=256, help="the limit is the measured floor plus this")
    ap.add_argument("--limit-mib", type=int, help="set the limit outright (no floor added)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per child (a child past it is killed)")
    ap.add_argument("--bare-timeout", type=float, default=150, help="seconds for the bare-limit import check")
    ap.add_argument("--max-others", type=float, default=0.3,
                    help="re-run a row during which other processes used more CPU than this (cores)")
    ap.add_argument("--retries", type=int, default=1, help="how many times a row may be re-run for that")
    ap.add_argument("--skip-bare", action="store_true", help="skip showing that the bare budget cannot hold the imports")
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--worker", choices=["prepare", "floor", "memory", "offload", "compress", "budget", "accelerate"])
    ap.add_argument("--offload-folder")
    args = ap.parse_args()
    if args.worker:
        watch_anon()
        if args.worker == "prepare":
            prepare_worker(args)
        elif args.worker == "floor":
            floor_worker(args)
        elif args.worker == "accelerate":
            accelerate_worker(args)
        else:
            lmdock_worker(args, args.worker)
        return

    table = _common().table
    root = memory_cgroup_root()
    print("cgroup v1 memory group:", f"children of {root}" if root else
          "CANNOT create one (no cgroup v1 memory controller, or not root): every run below is UNLIMITED", flush=True)
    prep = run_child(args, "prepare", root=None, limit=None, timeout=1800, files=[])
    if "prepare" not in prep["phases"]:
        sys.exit(f"preparing the model failed:\n{prep.get('stderr', '')}")
    info = prep["phases"]["prepare"]
    model = Path(info["model"])
    layouts = {k: Path(v["folder"]) for k, v in info["layouts"].items()}
    disk = {k: v["num_layers"] * v["layer_bytes"] for k, v in info["layouts"].items()}
    files = [model / "model.safetensors", *(f for lay in layouts.values() for f in lay.glob("layer_*.bin"))]
    def bandwidth(k: str) -> float:
        """O_DIRECT read bandwidth of layout ``k``, measured now (this VM's disk is not steady)."""
        drop_caches(files)
        best, passes = read_bandwidth(layouts[k])
        print(f"  layout {k}: {disk[k] / 1e9:.3f} GB, O_DIRECT read {', '.join(f'{r / 1e9:.2f}' for r in passes)} GB/s "
              f"-> batch-1 bound with every layer streamed {best / disk[k]:.2f} tok/s", flush=True)
        return best

    print(f"model: {model} ({info['model_bytes'] / 1e9:.3f} GB float32 safetensors)", flush=True)
    for k in layouts:
        bandwidth(k)

    floor = run_child(args, "floor", root=root, limit=None, timeout=args.timeout, files=files)
    fl = floor["phases"].get("floor", {})
    floor_mib = fl.get("rss_mib")
    if floor_mib is None:
        sys.exit(f"measuring the floor failed: {outcome(floor)}\n{floor.get('stderr', '')}")
    limit = (args.limit_mib if args.limit_mib else int(floor_mib) + args.budget_mib + 1) * MiB
    print(f"floor: {floor_mib:.0f} MiB resident ({fl['rss_anon_mib']:.0f} MiB anonymous, {fl['rss_file_mib']:.0f} MiB of mapped "
          "library files) after importing torch + transformers + lmdock and loading the tokenizer; "
          f"limit for the runs: {limit // MiB} MiB" + ("" if args.limit_mib else f" (floor + {args.budget_mib} MiB)"), flush=True)
    bare = None
    if root and not args.skip_bare:
        bare = run_child(args, "floor", root=root, limit=args.budget_mib * MiB, timeout=args.bare_timeout, files=files)
        print(f"imports alone under a bare {args.budget_mib} MiB limit: {outcome(bare)}", flush=True)

    configs = [("lmdock-hf in memory (no limit)", "memory", None), ("lmdock-hf offload, all layers on disk", "offload", limit),
               ("lmdock-hf offload, all on disk, compress_weight", "compress", limit),
               (f"lmdock-hf offload, memory_budget_gib = {args.budget_mib / 1024:g} (cost model)", "budget", limit)]
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        print(f"accelerate is NOT installed in {sys.executable}: the transformers + accelerate row is skipped", flush=True)
    elif not args.skip_accelerate:
        configs.append(("transformers + accelerate, all layers on disk", "accelerate", limit))
    results = {}
    for label, worker, lim in configs:
        extra: list[str] = []
        tmp = None
        print(f"{label}:", flush=True)
        bw = None
        if worker != "memory":  # the bound of this row, from the bytes it streams per step
            bw = bandwidth("compress" if worker == "compress" else "plain")
        for attempt in range(args.retries + 1):
            if worker == "accelerate":
                tmp = tempfile.mkdtemp(prefix="lmdock-accelerate-offload-")
                extra = ["--offload-folder", tmp]
            r = run_child(args, worker, root=root, limit=lim, timeout=args.timeout, files=files, extra=extra)
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            if r["cpu_others"] <= args.max_others or attempt == args.retries:
                break
            print(f"  other processes used {r['cpu_others']:.2f} cores during it ({r['wall']:.0f} s): running it again", flush=True)
        if bw:  # the bound: bytes this row streams a step (what the engine reported at load) / bandwidth
            r["bw"] = bw
            streamed = r["phases"].get("load", {}).get("streamed_bytes") or disk["compress" if worker == "compress" else "plain"]
            r["bound"] = bw / streamed
            print(f"  this row streams {streamed / 1e9:.3f} GB a step: batch-1 bound {r['bound']:.2f} tok/s", flush=True)
        results[worker] = r
        load = r["phases"].get("load", {})
        print(f"  {outcome(r)}; load {load.get('seconds', float('nan')):.1f} s; CPU used: {r['cpu_self']:.2f} cores by it, "
              f"{r['cpu_others']:.2f} by other processes", flush=True)
        if load.get("plan"):
            print("  plan:", load["plan"], flush=True)
        for b in ("batch1", f"batch{args.batch}"):
            p = r["phases"].get(b)
            if p:
                e = p["engine"]
                rate = f", engine read {e['bytes_read'] / e['read_seconds'] / 1e9:.2f} GB/s while reading" if e.get("read_seconds") else ""
                print(f"  {b}: {p['tok_s']:.2f} tok/s in {p['seconds']:.1f} s, /proc read_bytes {p['read_bytes'] / 1e9:.3f} GB, "
                      f"anon+shmem {p['private_mib']:.0f} MiB, engine {e}{rate}", flush=True)
        if r.get("stderr"):
            print("  stderr:", r["stderr"], flush=True)

    ref = results["memory"]["phases"]
    big = f"batch{args.batch}"

    def tok_s(r: dict[str, Any], b: str) -> str:
        p = r["phases"].get(b)
        return f"{p['tok_s']:.2f}" if p else "—"

    rows = []
    if bare:
        rows.append((f"imports only, bare {args.budget_mib} MiB", f"{args.budget_mib}", "—", "—", "—", "—", "—",
                     f"{bare['peak'] / MiB:.0f}", "—", f"{bare['failcnt']} / {bare['oom_kills']}", "—", "—",
                     f"{bare['cpu_others']:.1f}", outcome(bare)))
    for label, worker, lim in configs:
        r = results[worker]
        ph = r["phases"]
        b1, bb = ph.get("batch1"), ph.get(big)
        ratio_mem = f"{bb['tok_s'] / ref[big]['tok_s']:.2f}x" if bb and big in ref else "—"
        bound = f"{r['bound']:.2f} ({r['bw'] / 1e9:.2f} GB/s)" if "bound" in r else "—"
        ratio_bound = f"{b1['tok_s'] / r['bound']:.2f}x" if b1 and "bound" in r else "—"
        read = " / ".join(f"{ph[b]['read_bytes'] / 1e9:.2f}" if b in ph else "—" for b in ("batch1", big))
        anon = max((p["private_peak_mib"] for p in ph.values()), default=None)
        equal = []
        for b in ("batch1", big):
            if b in ph and b in ref:
                same = sum(x == y for x, y in zip(ph[b]["tokens"], ref[b]["tokens"]))
                equal.append("yes" if ph[b]["tokens"] == ref[b]["tokens"] else f"no ({same}/{len(ref[b]['tokens'])} rows)")
        rows.append((label, f"{lim // MiB}" if lim and root else "none", tok_s(r, "batch1"), tok_s(r, big), ratio_mem, bound,
                     ratio_bound, f"{r['peak'] / MiB:.0f}" if "peak" in r else "—", f"{anon:.0f}" if anon else "—",
                     f"{r['failcnt']} / {r['oom_kills']}" if "failcnt" in r else "—", read,
                     " / ".join(equal) if worker != "memory" else "(reference)", f"{r['cpu_others']:.1f}", outcome(r)))
    print()
    print(f"{args.prompt_len}-token prompts, {args.tokens} greedy new tokens, batch 1 and batch {args.batch}; "
          f"streamed per step: {disk['plain'] / 1e9:.3f} GB (plain layout), {disk['compress'] / 1e9:.3f} GB (compress_weight)")
    print(table(rows, ("configuration", "limit MiB", "tok/s b1", f"tok/s b{args.batch}", f"b{args.batch} vs in-memory",
                       "b1 disk bound tok/s", "b1 vs bound", "cgroup peak MiB", "anon+shmem peak MiB", "failcnt / OOM kills",
                       f"GB read b1 / b{args.batch}", f"greedy = in-memory b1 / b{args.batch}", "others' CPU (cores)", "outcome")))

if __name__ == "__main__":
    # benchmarks/mlx.py, onnx.py and vllm.py would shadow the packages of those names that
    # transformers probes for (its generate() imports "mlx.core" when find_spec("mlx") succeeds)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    main()
