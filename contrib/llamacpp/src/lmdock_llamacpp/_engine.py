"""A llama.cpp context as an lmdock step engine.

One ``llama_decode`` per step.  Each lmdock sequence holds one llama.cpp sequence id, taken from a
bounded pool (``n_seq_max``) when the sequence first appears and given back on ``release``; the KV
cache is unified (``kv_unified``), so all sequences share ``n_ctx`` cells and rows at different
positions decode in one batch, each seeing only its own sequence.  A step asks llama.cpp for the
logits of the rows the core needs only: the last token of each chunk, or every position of a chunk
with ``all_logits``.  ``release`` is ``llama_memory_seq_rm``; ``fork`` is ``llama_memory_seq_cp``,
which shares the cells rather than copying them; ``truncate`` (speculative decoding's rollback) is a
partial ``llama_memory_seq_rm``.

A recurrent or hybrid model (Mamba, RWKV, Granite 4, Falcon-H1, LFM2...) keeps one state per sequence
that holds everything up to its last position and cannot be cut back: ``llama_memory_seq_cp`` of the
first ``length`` positions copies the whole state, and a partial ``llama_memory_seq_rm`` fails.  Such
a model forks only at the source's full length (what ``n`` > 1, beam search and caching a prompt just
computed ask for); a shorter fork, a prefix-cache hit inside a cached prompt, returns False, so the
core computes the prompt itself; ``truncate`` returns False, so the core runs such a model without
speculative decoding.  Every memory call that reports failure raises a BackendError.

The batch lives in NumPy arrays that the ``llama_batch`` struct points into, one sequence id per
token, so filling a step is a few slice assignments.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
from lmdock import BackendError, ModelConfig, UnsupportedError
from lmdock.backend import SeqChunk, StepEngineBase, StepOutput

# llama.cpp's enums as llama-cpp-python exports them (its own copies of ggml.h / llama.h, which move
# with each release), never numbers copied here; GGML_TYPE_BF16 is the one it does not export (issue 26)
_GGML_TYPES = {name: getattr(lc, f"GGML_TYPE_{name.upper()}", None) for name in
               ("f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl")} | {"bf16": getattr(lc, "GGML_TYPE_BF16", 30)}
_FLASH = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED}
#: llama.cpp's file types that are not quantized
_FLOAT_FTYPES = {lc.LLAMA_FTYPE_ALL_F32: "F32", lc.LLAMA_FTYPE_MOSTLY_F16: "F16", lc.LLAMA_FTYPE_MOSTLY_BF16: "BF16"}
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")

log = logging.getLogger("lmdock.llamacpp")
_backend_ready = False
_log_callback: Any = None  # referenced for as long as llama.cpp may call it


# -- loading ----------------------------------------------------------------------------------------


def gguf_file(model: str) -> Path:
    """The .gguf file to load: ``model`` itself, or the single one in the folder ``model``."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise BackendError(f"{path} is not a .gguf file; lmdock-llamacpp loads GGUF models "
                               "(convert a transformers checkpoint with llama.cpp's convert_hf_to_gguf.py)")
        return path
    if not path.is_dir():
        raise BackendError(f"{model!r} is neither a .gguf file nor a folder holding one; lmdock-llamacpp does not "
                           "download: fetch the file first (huggingface-cli download REPO FILE.gguf)")
    found = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
    firsts = [p for p in found if (m := _SPLIT.search(p.name)) is None or m.group(1) == "00001"]
    if len(firsts) == 1:
        return firsts[0]
    if not firsts:
        raise BackendError(f"{path} holds no .gguf file; point the model at a .gguf file or a folder holding one")
    raise BackendError(f"{path} holds several GGUF models ({', '.join(p.name for p in firsts)}); "
                       "point the model at the file to load")


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (llama.cpp's own default count)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((base / "physical_package_id").read_text().strip(), (base / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def set_verbose(verbose: bool) -> None:
    """llama.cpp's log on stderr (its default), or silenced.  Process-wide, as llama.cpp's log is."""
    global _log_callback, _backend_ready
    if verbose:
        _log_callback = None
        lc.llama_log_set(None, None)  # llama.cpp's default: stderr
    else:
        _log_callback = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_log_callback, None)
    if not _backend_ready:
        lc.llama_backend_init()
        _backend_ready = True


def load(mc: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> LlamaCppStepEngine:
    path = gguf_file(mc.model)
    set_verbose(options.verbose)
    mparams = lc.llama_model_default_params()
    mparams.use_mmap = options.use_mmap
    mparams.use_mlock = options.use_mlock
    layers = options.n_gpu_layers
    if layers is None:
        layers = 0 if build.get("device") == "cpu" else -1
    mparams.n_gpu_layers = layers
    model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise BackendError(f"llama.cpp could not load {path} (set verbose = true in [backends.llamacpp] for its log)")
    try:
        file_type = check_quantization(model, path, quantization)
        engine = LlamaCppStepEngine(model, path, options, build, file_type, _tokenizer(mc, model))
    except BaseException:
        lc.llama_model_free(model)
        raise
    return engine


def _set(params: Any, **fields: Any) -> None:
    """Set fields of a llama.cpp parameter struct by name, refusing a name the installed
    llama-cpp-python's struct lacks: ctypes would take it as a plain attribute that llama.cpp never
    reads, so a field renamed upstream would silently do nothing (issue 26)."""
    known = {f[0] for f in type(params)._fields_}
    for name, value in fields.items():
        if name not in known:
            raise BackendError(
                f"llama-cpp-python {lc.__version__} has no {type(params).__name__}.{name}, which lmdock-llamacpp sets; "
                "install a llama-cpp-python inside the range lmdock-llamacpp declares (`lmdock backends` shows it)"
            )
        if value is None:
            raise BackendError(f"llama-cpp-python {lc.__version__} does not export the value lmdock-llamacpp sets for {name}")
        setattr(params, name, value)


def _ftype(model: Any) -> int:
    # files without general.file_type (older conversions) get a guessed type, flagged with 1024
    return lc.llama_model_ftype(model) & ~1024


def file_type_name(model: Any) -> str:
    """The GGUF's file type as llama.cpp names it (F32, Q8_0, Q4_K_M...)."""
    ftype = _ftype(model)
    names = {v: k[len("LLAMA_FTYPE_"):].removeprefix("MOSTLY_").removeprefix("ALL_")
             for k, v in vars(lc).items() if k.startswith("LLAMA_FTYPE_") and isinstance(v, int) and k != "LLAMA_FTYPE_GUESSED"}
    return names.get(ftype, f"ftype {ftype}")


def check_quantization(model: Any, path: Path, quantization: Any) -> str:
    """The file's type; with ``checkpoint_prequantized``, refuse a file that is not quantized."""
    name = file_type_name(model)
    if quantization and quantization.get("prequantized") and _ftype(model) in _FLOAT_FTYPES:
        raise UnsupportedError(
            f"checkpoint_prequantized = true (quantization {quantization['algo']!r}), but {path.name} holds {name} weights, "
            f"not quantized ones: quantize it with `llama-quantize {path.name} {path.stem}-q8_0.gguf Q8_0` and load that"
        )
    return name


def _tokenizer(mc: ModelConfig, model: Any) -> Any:
    if mc.tokenizer is None:
        from lmdock_llamacpp._tokenizer import GgufTokenizer

        return GgufTokenizer(model, lc.llama_model_get_vocab(model))
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise BackendError(f"tokenizer = {mc.tokenizer!r} needs transformers: pip install 'lmdock-llamacpp[hf-tokenizer]'; "
                           "or remove it to use the GGUF's own vocabulary") from None
    try:
        return AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise BackendError(f"lmdock-llamacpp could not load the tokenizer {mc.tokenizer!r}: {exc}") from exc


# -- the engine -------------------------------------------------------------------------------------


class _Batch:
    """A ``llama_batch`` whose arrays are NumPy buffers: one sequence id per token."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base, size = self.seq.ctypes.data, self.seq.itemsize
        self.seq_ptrs = (ctypes.POINTER(lc.llama_seq_id) * capacity)(
            *(ctypes.cast(base + i * size, ctypes.POINTER(lc.llama_seq_id)) for i in range(capacity)))
        self.struct = lc.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(ctypes.POINTER(lc.llama_token)),
            embd=None,
            pos=self.pos.ctypes.data_as(ctypes.POINTER(lc.llama_pos)),
            n_seq_id=self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=ctypes.cast(self.seq_ptrs, ctypes.POINTER(ctypes.POINTER(lc.llama_seq_id))),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )


class LlamaCppStepEngine(StepEngineBase):
    """A GGUF model in one llama.cpp context, with a unified KV cache shared by its sequences."""

    #: ``truncate`` cuts rejected speculative drafts (see the method; it answers False where it cannot)
    truncates = True

    def __init__(self, model: Any, path: Path, options: Any, build: dict[str, Any], file_type: str, tokenizer: Any) -> None:
        self.model = model
        self.path = path
        #: The GGUF's type, as llama.cpp names it ("F32", "Q8_0", "Q4_K_M"...).
        self.file_type = file_type
        vocab = lc.llama_model_get_vocab(model)
        self.ctx = self._context(options, build)
        n_ctx = lc.llama_n_ctx(self.ctx)
        train = lc.llama_model_n_ctx_train(model)
        # the scheduler keeps to kv_cache.max_tokens where given (llama.cpp rounds n_ctx up to 256)
        super().__init__(tokenizer, vocab_size=lc.llama_vocab_n_tokens(vocab), max_seq_len=min(n_ctx, train, build.get("max_seq_len") or train),
                         eos_token_ids=[t for t in dict.fromkeys((lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab))) if t >= 0],
                         kv_capacity_tokens=min(n_ctx, build.get("kv_max_tokens") or n_ctx))
        self.n_batch = lc.llama_n_batch(self.ctx)
        self._mem = lc.llama_get_memory(self.ctx)
        #: one state per sequence that cannot be cut back (see the module's docstring)
        self.recurrent = bool(lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model))
        #: the contract's name for it: the prefix cache reuses whole prompts only, and the core runs
        #: the model without speculative decoding (it could not drop rejected drafts) from the start
        self.fork_truncates = not self.recurrent
        self._told_partial_fork = False
        self._batch = _Batch(self.n_batch)
        self._llama_seq: dict[int, int] = {}  # lmdock seq id -> llama.cpp seq id
        self._length: dict[int, int] = {}  # llama.cpp seq id -> positions held
        self._free = list(range(self.n_seq_max - 1, -1, -1))  # a stack: low ids first

    def _context(self, options: Any, build: dict[str, Any]) -> Any:
        cp = lc.llama_context_default_params()
        train = lc.llama_model_n_ctx_train(self.model)
        n_batch = options.n_batch or build.get("max_num_batched_tokens") or 2048
        limit = lc.llama_max_parallel_sequences()
        # room for a full batch being released while the next is admitted (a burst of aborts: the ids of
        # the ending sequences are given back as the new ones take theirs), plus the prefix cache's
        # sequences and forks; max_num_seqs + 32 ran out under the conformance suite's 200 requests
        # with random aborts (2 runs in 6), where 2 x max_num_seqs + 32 never did (8 of 8)
        seqs = build.get("max_num_seqs") or 32
        self.n_seq_max = options.n_seq_max or min(limit, 2 * seqs + 32)
        threads = options.n_threads or physical_cores()
        float_file = self.file_type == "F32"
        kv = build.get("kv_type") or ("f32" if float_file else "f16")
        type_k, type_v = options.type_k or kv, options.type_v or kv
        flash = options.flash_attn or ("off" if type_k == type_v == "f32" else "auto")
        # llama.cpp pads n_ctx to a multiple of 256 only after it caps n_batch at the unpadded n_ctx; a
        # context under n_seq_max tokens (build.max_seq_len = a 16-token window) then aborts the process
        # in output_reserve (GGML_ASSERT n_outputs_max <= n_outputs_max, n_batch < n_seq_max): pad first
        n_ctx = -(-(options.n_ctx or build.get("kv_max_tokens") or min(build.get("max_seq_len") or train, train)) // 256) * 256
        if min(n_ctx, n_batch) < self.n_seq_max:
            raise BackendError(f"n_batch = {min(n_ctx, n_batch)} is below n_seq_max = {self.n_seq_max}, which llama.cpp "
                               "cannot run (it aborts the process); raise n_batch or lower n_seq_max in [backends.llamacpp]")
        _set(
            cp,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=options.n_ubatch or min(n_batch, 512),
            n_seq_max=self.n_seq_max,
            kv_unified=True,  # one KV pool for every sequence (see the module's docstring)
            # sliding-window layers keep every cell, not just the window: a fork or a prefix-cache hit
            # inside a longer prompt needs the cells before the window (llama.cpp's default; said here
            # because a pruned cache would make such forks silently wrong)
            swa_full=True,
            n_threads=threads,
            n_threads_batch=options.n_threads_batch or threads,
            type_k=_GGML_TYPES[type_k],
            type_v=_GGML_TYPES[type_v],
            flash_attn_type=_FLASH[flash],
            no_perf=True,
        )
        ctx = lc.llama_init_from_model(self.model, cp)
        if not ctx:
            raise BackendError(f"llama.cpp could not create a context for {self.path.name} (n_ctx={cp.n_ctx}, "
                               f"n_batch={cp.n_batch}, n_seq_max={cp.n_seq_max}, KV {options.type_k or kv}/{options.type_v or kv}); "
                               "a quantized V cache needs flash_attn = 'on'. Set verbose = true for llama.cpp's log")
        return ctx

    # -- the step-engine contract ---------------------------------------------------------------

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        total = sum(len(c.token_ids) for c in chunks)
        if total > self.n_batch:
            raise BackendError(f"a step of {total} tokens exceeds llama.cpp's n_batch ({self.n_batch}); "
                               "raise n_batch or lower scheduler.max_num_batched_tokens")
        b = self._batch
        taken: list[int] = []  # sequences new in this step: given back if the step fails
        lasts: list[int] = []  # output row of each chunk's last token
        spans: list[tuple[int, int, int]] = []  # (seq id, first output row, rows) for all_logits chunks
        i = out = 0
        try:
            for c in chunks:
                sid = self._seq(c, taken)
                n = len(c.token_ids)
                b.token[i : i + n] = c.token_ids
                b.pos[i : i + n] = np.arange(c.start, c.start + n, dtype=np.int32)
                b.seq[i : i + n] = sid
                if c.all_logits:
                    b.logits[i : i + n] = 1
                    spans.append((c.seq_id, out, n))
                    out += n
                else:
                    b.logits[i : i + n - 1] = 0
                    b.logits[i + n - 1] = 1
                    out += 1
                lasts.append(out - 1)
                i += n
            b.struct.n_tokens = i
            rc = lc.llama_decode(self.ctx, b.struct)
            if rc != 0:
                raise BackendError(self._decode_error(rc, i))
        except BaseException:
            for sid in taken:
                self._drop(sid)
            raise
        for c in chunks:
            self._length[self._llama_seq[c.seq_id]] = c.start + len(c.token_ids)
        ptr = lc.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(out, self.vocab_size))
        full = {seq_id: logits[row : row + n].copy() for seq_id, row, n in spans}
        return StepOutput(logits[lasts], full)  # fancy indexing copies out of llama.cpp's buffer

    def _seq(self, c: SeqChunk, taken: list[int]) -> int:
        """The llama.cpp sequence id of ``c``; a new one from the pool for a sequence not seen yet.
        KV positions at or after ``c.start`` are dropped (the core recomputes them)."""
        sid = self._llama_seq.get(c.seq_id)
        if sid is None:
            if c.start != 0:
                raise BackendError(f"sequence {c.seq_id} starts at position {c.start} but holds no KV state")
            if not self._free:
                raise BackendError(f"llama.cpp holds at most n_seq_max = {self.n_seq_max} sequences and all are in use; "
                                   "raise n_seq_max in [backends.llamacpp] (up to 256) or lower scheduler.max_num_seqs")
            sid = self._free.pop()
            self._llama_seq[c.seq_id] = sid
            self._length[sid] = 0
            taken.append(sid)
            return sid
        held = self._length[sid]
        if c.start > held:
            raise BackendError(f"sequence {c.seq_id} continues at position {c.start} but holds {held} positions")
        if c.start < held:
            self._seq_rm(sid, c.start, f"to recompute sequence {c.seq_id} from position {c.start}")
            self._length[sid] = c.start
        return sid

    def _decode_error(self, rc: int, tokens: int) -> str:
        if rc == 1:
            return (f"llama.cpp found no room for {tokens} token(s) in its KV cache (n_ctx = {self.kv_capacity_tokens} "
                    "cells shared by all sequences); raise kv_cache.max_tokens or n_ctx")
        return f"llama_decode failed with status {rc} on a batch of {tokens} token(s)"

    def _seq_rm(self, sid: int, start: int, why: str) -> None:
        """``llama_memory_seq_rm`` of positions ``start``.. (-1: all), its failure raised."""
        if not lc.llama_memory_seq_rm(self._mem, sid, start, -1):
            hint = " (a recurrent state cannot be cut back)" if self.recurrent and start > 0 else ""
            raise BackendError(f"llama_memory_seq_rm failed {why}: llama.cpp sequence {sid}, positions {start}..{hint}")

    def _drop(self, sid: int) -> None:
        self._seq_rm(sid, -1, "releasing a sequence")
        seq_id = next((k for k, v in self._llama_seq.items() if v == sid), None)
        if seq_id is not None:
            del self._llama_seq[seq_id]
        self._length.pop(sid, None)
        self._free.append(sid)

    def release(self, seq_id: int) -> None:
        sid = self._llama_seq.pop(seq_id, None)
        if sid is None:
            return
        del self._length[sid]
        self._free.append(sid)
        self._seq_rm(sid, -1, f"releasing sequence {seq_id}")

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        src = self._llama_seq.get(src_seq_id)
        if src is None or dst_seq_id in self._llama_seq or not self._free or length > self._length[src]:
            return False
        if self.recurrent and length != self._length[src]:
            if not self._told_partial_fork:
                log.info("%s has recurrent layers: their state cannot be cut back to a shorter prefix, so prefix reuse "
                         "inside a cached prompt is off for it (prompts are computed in full)", self.path.name)
                self._told_partial_fork = True
            return False
        dst = self._free[-1]
        self._seq_rm(dst, -1, "clearing a sequence to fork into")
        self._free.pop()
        lc.llama_memory_seq_cp(self._mem, src, dst, 0, length)  # returns nothing: no failure to check
        self._llama_seq[dst_seq_id] = dst
        self._length[dst] = length
        return True

    def truncate(self, seq_id: int, length: int) -> bool:
        """Drop positions ``length``.. of a sequence (speculative decoding's rejected tokens) with
        ``llama_memory_seq_rm(seq, length, -1)``.  A recurrent or hybrid model's state cannot be cut
        back: False, and the core runs it without speculation."""
        sid = self._llama_seq.get(seq_id)
        if sid is None:
            raise BackendError(f"truncate: sequence {seq_id} holds no KV state")
        if self.recurrent:
            return False
        if length < self._length[sid]:
            self._seq_rm(sid, length, f"to truncate sequence {seq_id} to {length} positions")
            self._length[sid] = length
        return True

    def num_sequences(self) -> int:
        return len(self._llama_seq)

    def close(self) -> None:
        if self.ctx is not None:
            lc.llama_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            if hasattr(self.tokenizer, "close"):
                self.tokenizer.close()  # it reads the model's vocabulary
            lc.llama_model_free(self.model)
            self.model = None
        self._llama_seq.clear()
        self._length.clear()
