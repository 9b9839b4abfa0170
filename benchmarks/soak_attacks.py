"""The hostile clients of ``benchmarks/soak.py --attacks`` (issue 39), each a loop until the soak's time
is up, counting what the server answered:

- ``wrong_types``: bodies whose fields have the wrong JSON type (a Messages block whose ``type`` is a
  list, a Responses ``role`` that is a list, a custom tool ``format`` that is a string, ...), and bytes
  that are not JSON: each must be a 4xx;
- ``big_store``: 0.9 MB ``/v1/responses`` bodies of small JSON objects, kept by the store (bounded in
  bytes), read back and continued with ``previous_response_id`` (a 404 / 400 once the store let them go);
- ``lora_names``: runtime LoRA adapters loaded under 64-character names up to the per-model cap (the
  next one a 400), a 404 for an unknown ``MODEL:ADAPTER`` (its body must stay small), one request under
  a real adapter, then all unloaded;
- ``grammars``: large grammars that compile (a Lark grammar of 500 chained rules, a 2,000-way choice);
  with ``crash_grammars`` also issue 39's crashing ones (5,000 chained rules; a tool schema whose
  ``$defs`` chain 5,000 deep, on ``/v1/messages`` with ``tool_choice`` auto), which must be 400s: they
  are refused only once grammars are checked in worker processes (the grammar branch of issue 39).

Every 5xx, dropped connection or unexpected status is counted as a failure of its kind.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

#: Bodies of the wrong shape, by route: each must be a 4xx.
WRONG: list[tuple[str, Any]] = [
    ("/v1/messages", {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}),
    ("/v1/messages", {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}),
    ("/v1/messages", {"model": "stories", "max_tokens": 4, "messages": [{"role": ["user"], "content": "x"}]}),
    ("/v1/messages", {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": ["auto"]}}),
    ("/v1/responses", {"model": "stories", "input": [{"type": "message", "role": ["user"], "content": "x"}]}),
    ("/v1/responses", {"model": "stories", "input": "x", "tools": [{"type": "custom", "name": "g", "format": "text"}]}),
    ("/v1/responses", {"model": "stories", "input": [{"type": "message", "role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}),
    ("/v1/responses", {"model": "stories", "input": [{"type": ["message"], "role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "stories", "messages": "x"}),
    ("/v1/chat/completions", {"model": "stories", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
    ("/v1/chat/completions", {"model": "stories", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": "y"}}),
    ("/v1/completions", {"model": "stories", "prompt": {"a": 1}}),
    ("/v1/completions", {"model": "stories", "prompt": "x", "max_tokens": "many"}),
    ("/v1/completions", b"{not json"),
    ("/tokenize", {"model": "stories", "messages": [{"role": {"x": 1}}]}),
    ("/v1/chat/completions", {"model": "stories", "messages": [{"role": ["user"], "content": "x"}]}),
]


def big_body(seed: int, kib: int = 900) -> dict[str, Any]:
    """A /v1/responses body of about ``kib`` KiB of small JSON objects (a tool's parameters)."""
    properties = {f"p{seed}_{j}": {"type": "string", "description": "d"} for j in range(kib * 1024 // 45)}
    return {"model": "stories", "input": "Once upon a time", "max_output_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": properties}}]}


def chained_lark(n: int) -> str:
    """A Lark grammar of ``n`` rules, each the next one's only use (issue 39: 5,000 crash llguidance)."""
    rules = [f"r{i}: r{i + 1}" for i in range(n - 1)] + [f'r{n - 1}: "a"']
    return "start: r0\n" + "\n".join(rules) + "\n"


def deep_defs(n: int) -> dict[str, Any]:
    """A JSON schema whose ``$defs`` chain ``n`` deep."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def make_adapter(model: Path, folder: Path) -> Path:
    """A PEFT-format adapter (random weights, a fixed seed) on stories260K's q/v projections."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    with safe_open(str(model / "model.safetensors"), "np") as f:
        for key in [k for k in f.keys() if k.endswith(("q_proj.weight", "v_proj.weight"))]:  # noqa: SIM118
            out_f, in_f = f.get_slice(key).get_shape()
            module = key.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(0, in_f**-0.5, (4, in_f)).astype(np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = rng.normal(0, 0.5, (out_f, 4)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return folder


class Attacks:
    """The attack loops against one server; ``counts[kind, outcome]``."""

    def __init__(self, http: Any, url: str, adapter: Path, crash_grammars: bool, pause: float = 0.0) -> None:
        """``pause``: seconds each attacker waits between its requests (a mix, not a flood)."""
        self.http, self.url, self.adapter, self.crash_grammars, self.pause = http, url, adapter, crash_grammars, pause
        self.counts: Counter[tuple[str, str]] = Counter()

    def failures(self) -> int:
        return sum(n for (_, outcome), n in self.counts.items() if outcome != "ok")

    async def _post(self, kind: str, path: str, body: Any, ok: tuple[int, ...], timeout: float = 120.0) -> Any:
        import httpx

        try:
            if isinstance(body, bytes):
                r = await self.http.post(self.url + path, content=body, headers={"content-type": "application/json"}, timeout=timeout)
            else:
                r = await self.http.post(self.url + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:  # a dropped connection, or no answer in time
            self.counts[kind, f"dropped ({type(exc).__name__})"] += 1
            return None
        self.counts[kind, "ok" if r.status_code in ok else f"status {r.status_code}"] += 1
        await asyncio.sleep(self.pause)
        return r

    async def wrong_types(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            for path, body in WRONG:
                await self._post("wrong_types", path, body, (400, 404, 422))

    async def big_store(self, stop_at: float, rounds: int | None = None) -> None:
        i = 0
        while time.monotonic() < stop_at and (rounds is None or i < rounds):
            r = await self._post("big_store", "/v1/responses", big_body(i), (200,))
            if r is not None and r.status_code == 200:
                rid = r.json()["id"]
                got = await self.http.get(f"{self.url}/v1/responses/{rid}", timeout=60)
                self.counts["big_store", "ok" if got.status_code in (200, 404) else f"GET {got.status_code}"] += 1
                await self._post("big_store", "/v1/responses", {"model": "stories", "previous_response_id": rid,
                                                                  "input": "and then", "max_output_tokens": 2}, (200, 400))
            i += 1

    async def lora_names(self, stop_at: float, rounds: int | None = None) -> None:
        i = 0
        while time.monotonic() < stop_at and (rounds is None or i < rounds):
            names = []
            for j in range(200):  # past the cap (128 a model): the rest are 400s
                name = f"{i:04d}-{j:03d}-" + "n" * 55
                r = await self._post("lora_names", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(self.adapter)},
                                     (200, 400))
                if r is not None and r.status_code == 200:
                    names.append(name)
                elif r is not None:
                    break
            r = await self._post("lora_names", "/v1/completions", {"model": "stories:unknown", "prompt": "x", "max_tokens": 1}, (404,))
            if r is not None and len(r.content) > 20_000:
                self.counts["lora_names", "a 404 body over 20 KB"] += 1
            if names:
                await self._post("lora_names", "/v1/completions", {"model": f"stories:{names[0]}", "prompt": "Once upon a time",
                                                                   "max_tokens": 8}, (200,))
            for name in names:
                await self._post("lora_names", "/v1/unload_lora_adapter", {"lora_name": name}, (200,))
            i += 1

    async def grammars(self, stop_at: float, rounds: int | None = None) -> None:
        bodies: list[tuple[str, dict[str, Any], tuple[int, ...]]] = [
            ("/v1/completions", {"model": "stories", "prompt": "x", "max_tokens": 4, "guided_grammar": chained_lark(500)}, (200, 400)),
            ("/v1/completions", {"model": "stories", "prompt": "x", "max_tokens": 4,
                                 "guided_choice": [f"choice {i}" for i in range(2000)]}, (200, 400)),
        ]
        if self.crash_grammars:
            bodies += [
                ("/v1/completions", {"model": "stories", "prompt": "x", "max_tokens": 4, "guided_grammar": chained_lark(5000)}, (400,)),
                ("/v1/messages", {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"name": "f", "input_schema": deep_defs(5000)}], "tool_choice": {"type": "auto"}}, (400,)),
            ]
        i = 0
        while time.monotonic() < stop_at and (rounds is None or i < rounds):
            for path, body, ok in bodies:
                await self._post("grammars", path, body, ok)
            i += 1

    def report(self) -> list[str]:
        kinds = sorted({k for k, _ in self.counts})
        lines = []
        for kind in kinds:
            outcomes = {o: n for (k, o), n in self.counts.items() if k == kind}
            lines.append(f"  {kind}: " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
        return lines
