"""How ``lmdock generate`` and ``lmdock chat`` print outputs: plain, labelled, streamed or JSON."""

from __future__ import annotations

import json
import sys
from typing import Any


def label(prompt: int, index: int, prompts: int, n: int) -> str:
    parts = ([f"prompt {prompt}"] if prompts > 1 else []) + ([f"completion {index}"] if n > 1 else [])
    return f"=== {', '.join(parts)} ==="


class StreamPrinter:
    """Prints the new text of streaming snapshots.  One completion: the bare text.  Several (prompts or
    ``-n``): each piece under its completion's label, repeated whenever the output switches completion.
    JSON: one object per line per piece, ``{"prompt", "index", "text", "finish_reason"}``."""

    def __init__(self, labelled: bool, as_json: bool, prompts: int = 1, n: int = 1) -> None:
        self.labelled = labelled
        self.prompts, self.n = prompts, n
        self.as_json = as_json
        self.sent: dict[tuple[int, int], int] = {}
        self.finished: set[tuple[int, int]] = set()
        self.current: tuple[int, int] | None = None

    def snapshot(self, prompt: int, out: Any) -> None:
        for comp in out.outputs:
            key = (prompt, comp.index)
            sent = self.sent.get(key, 0)
            delta = comp.text[sent:]
            done = comp.finish_reason is not None and key not in self.finished
            if not delta and not done:
                continue
            self.sent[key] = len(comp.text)
            if done:
                self.finished.add(key)
            if self.as_json:
                sys.stdout.write(json.dumps({"prompt": prompt, "index": comp.index, "text": delta, "finish_reason": comp.finish_reason}) + "\n")
            elif delta:
                if self.labelled and key != self.current:
                    sys.stdout.write(("\n" if self.current is not None else "") + label(prompt, comp.index, self.prompts, self.n).strip("= ").join("[]") + " ")
                self.current = key
                sys.stdout.write(delta)
        sys.stdout.flush()

    def end(self) -> None:
        if not self.as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()


def output_json(out: Any) -> dict[str, Any]:
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "outputs": [
            {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in out.outputs
        ],
    }
