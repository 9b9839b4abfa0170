"""mlx-lm models as an lmdock step engine.

Each sequence keeps its own mlx-lm prompt cache (one ``KVCache`` per layer).  A step builds the
graphs of every chunk lazily and evaluates them together, so MLX schedules the work of all
sequences at once; the last logits stay MLX arrays for the sampler (``lmdock_mlx._sampler``).  Sequences decoding together share one
``BatchKVCache`` (the decode group).

Running ahead: when the core says the decode group's rows (or the one sequence decoding alone) will
take the argmax (``SeqChunk.argmax_next``), the step also builds the next forward from the argmax on
the device and queues it (``mx.async_eval``) before handing the logits back, as mlx-lm's generators
do: MLX computes step t+1 while the core samples, detokenizes and reports step t, and building the
next graph no longer waits for the host.  The next step takes that result when its chunks bring
exactly the tokens run ahead with, at its positions; otherwise (a token differs, a sequence joins or
skips a step, ``truncate`` cuts the sequence back) the position is trimmed from the caches and the
step computes as usual.  A group row
that leaves is filtered out of the queued result too; a fork copies only positions before it.

mlx-lm reads a top-level ``rope_theta`` and ignores transformers 5's ``rope_parameters``: when a
config has only the latter, the engine passes its value to mlx-lm explicitly instead of letting the
default rotary base apply silently.

LoRA adapters (``lmdock_mlx._lora``) add their low-rank updates per row: a forward the engine builds
(a chunk alone, the decode group, a step run ahead) with rows under adapters first says which adapter
each row runs under, which puts the targeted layers' wrappers in place until its graph is built; a
forward with no adapter runs the untouched model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from lmdock import BackendError, LoRARequest, ModelConfig, UnsupportedError
from lmdock.backend import SeqChunk, StepEngineBase, StepOutput, read_model_json

from lmdock_mlx._gpt2 import load_gpt2
from lmdock_mlx._gpt_oss import load_gpt_oss
from lmdock_mlx._granite_hybrid import BAMBA_KEYS, granite_layer_types, granite_positions, load_bamba, time_step_limit
from lmdock_mlx._lora import Adapters

#: Keys transformers 5 writes under names mlx-lm 0.32 does not read, by model_type: {mlx-lm's name:
#: transformers 5's}.  Without them the load fails (a missing ModelArgs field); kept in one place so
#: the drift is visible and ends where mlx-lm catches up.
KEY_NAMES: dict[str, dict[str, str]] = {
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "gpt2": {"n_ctx": "n_positions"},
    "lfm2": {"block_dim": "hidden_size", "block_ff_dim": "intermediate_size"},  # mlx-lm 0.30 requires block_ff_dim
}


def _full_every(config: dict[str, Any]) -> int | None:
    """The period p of transformers 5's ``layer_types`` where every p-th layer is full attention and
    the others are not (Gemma 3's ``sliding_window_pattern``, Qwen3-Next's
    ``full_attention_interval``); an error where the layer types follow no such pattern."""
    types = config.get("layer_types")
    if not isinstance(types, list) or not types:
        return None
    period = next((i + 1 for i, t in enumerate(types) if t == "full_attention"), len(types) + 1)
    if period <= len(types) and all((t == "full_attention") == ((i + 1) % period == 0) for i, t in enumerate(types)):
        return period
    raise UnsupportedError(f"layer_types {types}: mlx-lm's {config.get('model_type')} makes every n-th layer full attention "
                           "and cannot run this arrangement; use backend = 'hf'")


#: Keys mlx-lm 0.32 reads whose value transformers 5 writes in another form, by model_type: {mlx-lm's
#: key: how to compute it from the config (None: nothing to change)}.  Without them Gemma 3 and
#: Qwen3-Next take mlx-lm's default layer pattern whatever the checkpoint's layers are, and Granite 4
#: hybrids fail to load or get rotary positions they do not have (lmdock_mlx._granite_hybrid).
KEY_VALUES: dict[str, dict[str, Any]] = {
    "gemma3_text": {"sliding_window_pattern": _full_every},
    "qwen3_next": {"full_attention_interval": _full_every},
    "granitemoehybrid": {"layer_types": granite_layer_types, "position_embedding_type": granite_positions,
                         "time_step_limit": time_step_limit},
    "bamba": BAMBA_KEYS,  # run on mlx-lm's granitemoehybrid (LOADERS)
}

#: Families lmdock-mlx loads with its own classes on an mlx-lm port (another family's, for Bamba), translating
#: the checkpoint in memory: model_type -> load(model, model_config=overrides)
LOADERS = {"bamba": load_bamba, "gpt2": load_gpt2, "gpt_oss": load_gpt_oss}


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """What mlx-lm must be told beside config.json: the rotary keys spelled the old way, the renamed
    keys of :data:`KEY_NAMES` and the translated values of :data:`KEY_VALUES`."""
    out = rope_overrides(config)
    family = config.get("model_type", "")
    for old, new in KEY_NAMES.get(family, {}).items():
        if old not in config and new in config:
            out[old] = config[new]
    for key, compute in KEY_VALUES.get(family, {}).items():
        if (value := compute(config)) is not None and value != config.get(key):
            out[key] = value
    return out


def rope_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The config keys mlx-lm needs spelled the old way (from transformers 5's rope_parameters): a
    rotary base, and for gpt-oss its YaRN scaling as rope_scaling; Gemma 3's per-layer-type
    parameters as its global base and local base (``rope_local_base_freq``)."""
    rope = config.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):  # {layer type: parameters} (Gemma 3)
        return _per_layer_type_rope(config, rope)
    out: dict[str, Any] = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in config and key in rope:
            out[key] = rope[key]
    kind = rope.get("rope_type", "default")
    if kind != "default" and "rope_scaling" not in config:
        if config.get("model_type") == "gpt_oss" and kind == "yarn":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
            return out
        raise UnsupportedError(
            f"this config has rope_parameters with rope_type {kind!r} and no rope_scaling, which mlx-lm reads; "
            "add a rope_scaling entry to config.json"
        )
    return out


def _per_layer_type_rope(config: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    full, local = rope["full_attention"], rope.get("sliding_attention") or {}
    if config.get("model_type") != "gemma3_text" or local.get("rope_type", "default") != "default":
        raise UnsupportedError(f"rope_parameters per layer type {sorted(rope)}: lmdock-mlx passes them to mlx-lm for Gemma 3 "
                               "only, with default (unscaled) rotary positions on its sliding layers; use backend = 'hf'")
    out: dict[str, Any] = {}
    if "rope_theta" not in config and "rope_theta" in full:
        out["rope_theta"] = full["rope_theta"]
    if "rope_local_base_freq" not in config and "rope_theta" in local:
        out["rope_local_base_freq"] = local["rope_theta"]
    if full.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}  # mlx-lm scales the global layers only
    return out


#: Families whose mlx-lm attention cannot take a BatchKVCache's mask: Gemma 2 reshapes its queries to
#: five dimensions for grouped-query attention, against which the cache's (batch, 1, 1, length) mask
#: broadcasts into the wrong shape (a step of several sequences fails in a reshape).  Their sequences
#: decode each in its own cache.
NO_DECODE_GROUP = frozenset({"gemma2"})


class _Ahead:
    """A decode step run ahead from the argmax: the sequences it covers (the decode group's rows, or
    one sequence decoding alone), the tokens it was fed, its queued float32 logits, and the caches
    that already hold its position."""

    def __init__(self, seq_ids: list[int], starts: list[int], spec: Any, logits: Any, layers: list[Any]) -> None:
        self.seq_ids = seq_ids
        self.starts = starts  # the position each sequence's token took
        self.spec = spec
        self.tokens: list[int] = []
        self.logits = logits
        self.layers = layers

    def matches(self, decode: Sequence[SeqChunk]) -> bool:
        """True when this step's decode chunks are exactly these sequences, at the positions and
        with the tokens run ahead."""
        if len(decode) != len(self.seq_ids):
            return False
        fed = {s: (t, p) for s, t, p in zip(self.seq_ids, self.tokens, self.starts)}
        return all(fed.get(c.seq_id) == (c.token_ids[0], c.start) for c in decode)

    def undo(self) -> None:
        """Take the position out of the caches (the next step writes over it)."""
        for layer in self.layers:
            layer.trim(1)


class MlxStepEngine(StepEngineBase):

    #: ``truncate`` cuts rejected speculative drafts (see the method; it answers False where it cannot)
    truncates = True
    def __init__(self, model: Any, tokenizer: Any, eos: tuple[int, ...], max_seq_len: int, vocab_size: int, generation_config: dict[str, Any],
                 kv_max_tokens: int | None, lora_limits: tuple[int | None, int | None] = (None, None)) -> None:
        """``lora_limits``: ``build.max_loras`` and ``build.max_lora_rank``."""
        super().__init__(tokenizer, vocab_size=vocab_size, max_seq_len=max_seq_len, eos_token_ids=eos,
                         generation_config=generation_config, kv_capacity_tokens=kv_max_tokens)
        #: on the GPU (Metal) the CPU waits while MLX evaluates: the core overlaps its output work
        self.overlap_host_work = mx.default_device().type == mx.DeviceType.gpu
        self.model = model
        self.caches: dict[int, list[Any]] = {}
        # The decode group: sequences decoding together keep one left-padded BatchKVCache per layer
        # across steps (row i is group_ids[i]); their per-sequence caches are not in self.caches.
        self.group_ids: list[int] = []
        self.group: list[Any] = []
        #: the next decode step, run ahead (see the module docstring)
        self.ahead: _Ahead | None = None
        #: LoRA adapters, each checked by the first request that names it (``prepare_lora``)
        self.adapters: Adapters | None = Adapters(model, *lora_limits)
        #: the adapter of each sequence that runs under one (the decode group's rows are forwarded by seq id)
        self.loras: dict[int, LoRARequest] = {}
        #: whether sequences decoding together share one BatchKVCache (see NO_DECODE_GROUP)
        self.decode_group = True

    @classmethod
    def load(cls, mc: ModelConfig, options: Any, quantization: Any, build: dict[str, Any]) -> MlxStepEngine:
        from mlx.utils import tree_flatten
        from mlx_lm import load as mlx_load

        device = build.get("device", "auto")
        if device == "cpu":
            mx.set_default_device(mx.cpu)
        elif device in ("gpu", "metal"):
            mx.set_default_device(mx.gpu)
        config = read_model_json(mc.model, "config.json")
        try:
            load = LOADERS.get(config.get("model_type", ""), mlx_load)
            model, wrapper = load(mc.model, model_config=config_overrides(config))
        except UnsupportedError:
            raise
        except Exception as exc:
            raise BackendError(f"mlx-lm could not load {mc.model!r}: {type(exc).__name__}: {exc}") from exc
        if build.get("dtype", "auto") != "auto":
            model.set_dtype(getattr(mx, build["dtype"]))
        if quantization and "bits" in quantization:
            import mlx.nn as nn

            group = quantization["group_size"]
            # as mlx_lm.convert does: layers whose input width the group size does not divide stay float
            nn.quantize(model, group_size=group, bits=quantization["bits"],
                        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group == 0)
        # MLX streams belong to threads: materialize the weights here, not lazily in the engine thread, and the
        # arrays modules keep beside them (mlx-lm's YarnRoPE frequencies: "no Stream(cpu, 0)" in the engine thread)
        mx.eval([v for _, v in tree_flatten(model) if isinstance(v, mx.array)])
        tokenizer = getattr(wrapper, "_tokenizer", wrapper)
        eos = tuple(dict.fromkeys(int(t) for t in (getattr(wrapper, "eos_token_ids", None) or [tokenizer.eos_token_id]) if t is not None))
        limit = int(config.get("max_position_embeddings") or config.get("n_positions") or 4096)  # GPT-2: n_positions
        max_seq_len = min(build["max_seq_len"], limit) if build.get("max_seq_len") else limit
        vocab = int(config.get("vocab_size") or len(tokenizer))
        engine = cls(model, tokenizer, eos, max_seq_len, vocab, read_model_json(mc.model, "generation_config.json"), build.get("kv_max_tokens"),
                     (build.get("max_loras"), build.get("max_lora_rank")))
        engine.decode_group = config.get("model_type") not in NO_DECODE_GROUP
        return engine

    # -- the step-engine contract (StepEngineBase: prepare_lora and max_loras from ``adapters``) -------

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        from mlx_lm.models.cache import make_prompt_cache

        pending: list[Any] = [None] * len(chunks)
        if self.adapters:
            self.loras.update((c.seq_id, c.lora) for c in chunks if c.lora is not None)
        decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1 and not c.all_logits and c.start > 0 and self._decodable(c.seq_id)]
        ahead, self.ahead = self.ahead, None
        if ahead is not None and not ahead.matches([chunks[i] for i in decode]):
            ahead.undo()
            ahead = None
        self._regroup([chunks[i].seq_id for i in decode] if len(decode) > 1 and self.decode_group else [])
        group_logits = None
        if self.group_ids:
            group_logits = ahead.logits if ahead is not None else self._decode_group({chunks[i].seq_id: chunks[i].token_ids[0] for i in decode})
        elif ahead is not None:  # one sequence decoding alone, in its own cache
            pending[decode[0]] = ahead.logits
        grouped = set(decode) if group_logits is not None else set()
        for i, c in enumerate(chunks):
            if i in grouped or pending[i] is not None:
                continue
            cache = self.caches.get(c.seq_id)
            if cache is None or c.start == 0:
                cache = self.caches[c.seq_id] = make_prompt_cache(self.model)
            logits = self._forward(mx.array([list(c.token_ids)]), cache, [c.lora])[0]
            pending[i] = (logits if c.all_logits else logits[-1:]).astype(mx.float32)
        outs = [a for a in pending if a is not None] + ([group_logits] if group_logits is not None else [])
        nxt: _Ahead | None = None
        if group_logits is not None and all(chunks[i].argmax_next for i in decode):
            spec = mx.argmax(group_logits, axis=-1)
            mx.async_eval(spec, *outs)
            # built while MLX computes this step; computed while the core samples it
            start = {chunks[i].seq_id: chunks[i].start + 1 for i in decode}
            nxt = _Ahead(list(self.group_ids), [start[s] for s in self.group_ids], spec, self._forward_group(spec[:, None]), self.group)
        elif len(decode) == 1 and not self.group_ids and chunks[decode[0]].argmax_next:
            c = chunks[decode[0]]
            cache = self.caches[c.seq_id]
            spec = mx.argmax(pending[decode[0]], axis=-1)
            mx.async_eval(spec, *outs)
            nxt = _Ahead([c.seq_id], [c.start + 1], spec, self._forward(spec[None], cache, [c.lora])[0].astype(mx.float32), cache)
        else:
            mx.eval(outs)  # every sequence's graph at once
        if self.adapters:
            self.adapters.evict(lora.key for lora in self.loras.values())
        if nxt is not None:
            mx.async_eval(nxt.logits)
        try:
            parts: list[Any] = [None] * len(chunks)
            if group_logits is not None:
                row_of = {s: r for r, s in enumerate(self.group_ids)}
                for i in decode:
                    parts[i] = group_logits[row_of[chunks[i].seq_id]]
            full: dict[int, np.ndarray] = {}
            for i, (c, logits) in enumerate(zip(chunks, pending)):
                if logits is None:
                    continue
                parts[i] = logits[-1]
                if c.all_logits:
                    full[c.seq_id] = np.array(logits)
            # kept in MLX for the sampler (lmdock_mlx._sampler); evaluated here, which waits for
            # this step only, so a failing step fails here, where its run-ahead is undone
            last = mx.stack(parts) if parts else mx.zeros((0, self.vocab_size), dtype=mx.float32)
            mx.eval(last)
            if nxt is not None:
                nxt.tokens = nxt.spec.tolist()
        except BaseException:
            if nxt is not None:  # the step fails (its sequences are released): leave no position behind
                nxt.undo()
            raise
        self.ahead = nxt  # kept only once this step has succeeded
        return StepOutput(last, full)

    def _decodable(self, seq_id: int) -> bool:
        from mlx_lm.models.cache import KVCache

        if seq_id in self.group_ids:
            return True
        cache = self.caches.get(seq_id)
        return cache is not None and all(type(c) is KVCache for c in cache)

    def _regroup(self, members: list[int]) -> None:
        """Make the decode group hold exactly ``members``: rows of sequences that leave are taken out
        (their caches go back to self.caches) and the caches of those that join are merged in.  A
        steady batch pays nothing here; only joins and leaves copy KV state."""
        from mlx_lm.models.cache import BatchKVCache

        wanted = set(members)
        leaving = [s for s in self.group_ids if s not in wanted]
        for s in leaving:
            row = self.group_ids.index(s)
            self.caches[s] = [layer.extract(row) for layer in self.group]
        if leaving:
            self._drop_rows(leaving)
        joining = [s for s in members if s not in self.group_ids]
        if not joining:
            return
        per_seq = [self.caches.pop(s) for s in joining]
        merged = [BatchKVCache.merge([layers[i] for layers in per_seq]) for i in range(len(per_seq[0]))]
        if self.group:
            for layer, extra in zip(self.group, merged):
                layer.extend(extra)
        else:
            self.group = merged
        self.group_ids += joining

    def _drop_rows(self, seq_ids: list[int]) -> None:
        keep = [r for r, s in enumerate(self.group_ids) if s not in seq_ids]
        ahead = self.ahead if self.ahead is not None and self.ahead.layers is self.group else None
        if not keep:
            self.group_ids, self.group = [], []
            if ahead is not None:
                self.ahead = None
            return
        index = mx.array(keep)
        for layer in self.group:
            layer.filter(index)
        self.group_ids = [self.group_ids[r] for r in keep]
        if ahead is not None:  # the other rows' step run ahead stays valid: rows are independent
            ahead.seq_ids, ahead.logits = list(self.group_ids), ahead.logits[index]
            ahead.tokens, ahead.starts = [ahead.tokens[r] for r in keep], [ahead.starts[r] for r in keep]

    def _decode_group(self, tokens: dict[int, int]) -> Any:
        """One forward for the group: one new token per row, each row at its own position (mlx-lm's
        BatchKVCache keeps per-row RoPE offsets and the left-padding mask)."""
        return self._forward_group(mx.array([[tokens[s]] for s in self.group_ids]))

    def _forward_group(self, ids: Any) -> Any:
        return self._forward(ids, self.group, [self.loras.get(s) for s in self.group_ids] if self.loras else [])[:, -1].astype(mx.float32)

    def _forward(self, ids: Any, cache: Any, loras: list[LoRARequest | None]) -> Any:
        """Build the model's forward over ``ids``, each row under its adapter (None: the base model)."""
        if not self.adapters or not any(loras):
            return self.model(ids, cache=cache)
        self.adapters.select(loras)
        try:
            return self.model(ids, cache=cache)
        finally:
            self.adapters.clear()

    def release(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)
        self.loras.pop(seq_id, None)
        if seq_id in self.group_ids:
            self._drop_rows([seq_id])
        elif self.ahead is not None and self.ahead.seq_ids == [seq_id]:
            self.ahead = None

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        from mlx_lm.models.cache import KVCache

        # a step run ahead may cover src: its position lies beyond ``length``, which is never copied
        if src_seq_id in self.group_ids:
            row = self.group_ids.index(src_seq_id)
            src = [layer.extract(row) for layer in self.group]
        else:
            src = self.caches.get(src_seq_id)
        if src is None or not all(type(c) is KVCache for c in src):
            return False
        copies = []
        for c in src:
            new = KVCache()
            new.keys, new.values = c.keys[..., :length, :], c.values[..., :length, :]
            new.offset = length
            copies.append(new)
        self.caches[dst_seq_id] = copies
        return True

    def truncate(self, seq_id: int, length: int) -> bool:
        """Drop positions ``length``.. of a sequence (speculative decoding's rejected tokens) with
        mlx-lm's ``trim``.  A step run ahead over the sequence is undone first (its position lies
        beyond what is kept), and a decode-group row leaves the group (``BatchKVCache`` trims all its
        rows at once).  False where a layer's cache cannot be cut back: a recurrent (SSM / conv) state,
        a sliding window that has wrapped around."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if self.ahead is not None and seq_id in self.ahead.seq_ids:
            self.ahead.undo()  # the other rows it covers recompute their step: nothing else changes
            self.ahead = None
        if seq_id in self.group_ids:
            row = self.group_ids.index(seq_id)
            self.caches[seq_id] = [layer.extract(row) for layer in self.group]
            self._drop_rows([seq_id])
        cache = self.caches.get(seq_id)
        if cache is None:
            raise BackendError(f"truncate: sequence {seq_id} holds no KV state")
        if not can_trim_prompt_cache(cache):
            return False
        held = max(layer.offset for layer in cache)
        if length < held:
            trim_prompt_cache(cache, held - length)
        return True

    def thread_exit(self) -> None:
        """Called in the engine thread as it ends: MLX streams belong to the thread that made them,
        and a stream left behind aborts the process at exit ("terminate called without an active
        exception")."""
        self.caches.clear()
        self.loras.clear()
        self.group_ids, self.group, self.ahead = [], [], None
        mx.synchronize()
        mx.clear_streams()

    def num_sequences(self) -> int:
        return len(self.caches) + len(self.group_ids)

    def close(self) -> None:
        self.caches.clear()
        self.group_ids, self.group, self.ahead = [], [], None
        self.loras.clear()
        self.model = None
        self.adapters = None  # its weights go with the model
