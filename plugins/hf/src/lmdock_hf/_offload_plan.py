"""The offload cost model: where layers and the KV cache go, and the batch, from the policy's
percentages or its ``memory_budget_gib``."""

from __future__ import annotations

from dataclasses import dataclass

from lmdock import OffloadPolicy, UnsupportedError


@dataclass
class Plan:
    resident_layers: int  # the first N decoder layers stay resident (accelerator share first)
    gpu_layers: int  # of those, how many on the accelerator (0 on CPU)
    kv_on_accelerator: bool
    batch_size: int | None
    note: str

    def describe(self, num_layers: int) -> str:
        return (
            f"{self.gpu_layers} of {num_layers} decoder layers on the accelerator, "
            f"{self.resident_layers - self.gpu_layers} in RAM, {num_layers - self.resident_layers} streamed from disk; "
            f"KV cache {'on the accelerator' if self.kv_on_accelerator else 'in RAM'}; "
            f"batch {self.batch_size if self.batch_size else 'from the scheduler'}. {self.note}"
        )


def plan(policy: OffloadPolicy, *, num_layers: int, layer_bytes: int, disk_layer_bytes: int, resident_bytes: int, kv_bytes_per_token: int, seq_len: int, default_batch: int, bandwidth: float | None, accelerator: bool) -> Plan:
    """Placement and batch: from the percentages, or from ``memory_budget_gib`` when it is set.

    The budget model (FlexLLMGen's, cut down to the CPU/disk case): the budget pays for the resident
    parts (embeddings, norms, LM head), two layer buffers, and the KV cache of the batch; what is
    left keeps whole decoder layers resident, so fewer bytes stream per step.  The batch is the
    largest (up to the scheduler's ``max_num_seqs``) whose KV cache fits after the buffers; a larger
    batch amortizes each layer's read over more tokens, which is the whole point at batch 1 (a step
    costs ``streamed bytes / bandwidth`` whatever the batch).
    """
    kv = policy.kv_cache_gpu_percent >= 100.0 and accelerator
    if policy.memory_budget_gib is None:
        resident = num_layers * (policy.weights_gpu_percent + policy.weights_cpu_percent) / 100.0
        gpu = num_layers * policy.weights_gpu_percent / 100.0 if accelerator else 0
        return Plan(int(round(resident)), int(round(gpu)), kv, policy.batch_size, "placement from the policy's percentages")
    budget = int(policy.memory_budget_gib * 2**30)
    fixed = resident_bytes + 2 * layer_bytes
    if fixed > budget:
        raise UnsupportedError(
            f"memory_budget_gib={policy.memory_budget_gib:g} is below what streaming needs: "
            f"{fixed / 2**20:.0f} MiB (resident embeddings/norms/head + two layer buffers)"
        )
    want = policy.batch_size or default_batch
    per_seq = kv_bytes_per_token * seq_len
    batch = max(1, min(want, (budget - fixed) // max(per_seq, 1)))
    left = budget - fixed - batch * per_seq
    resident = int(min(num_layers, max(0, left // max(layer_bytes, 1))))
    bw = f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "not measured"
    streamed = (num_layers - resident) * disk_layer_bytes
    step = streamed / bandwidth if bandwidth else float("nan")
    note = (
        f"Chosen from memory_budget_gib={policy.memory_budget_gib:g}: read bandwidth {bw}, "
        f"{streamed / 2**20:.0f} MiB streamed per step (~{step * 1e3:.0f} ms), "
        f"KV {per_seq / 2**20:.2f} MiB per sequence of {seq_len} tokens{' (4-bit, compress_cache)' if policy.compress_cache else ''}."
    )
    return Plan(resident, resident if accelerator else 0, kv, batch, note)
