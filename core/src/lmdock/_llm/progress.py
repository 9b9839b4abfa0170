"""A small progress bar for large offline batches; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool | None = None, label: str = "Processed prompts") -> None:
        self.total = total
        self.done = 0
        self.tokens = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.label = label
        self.start = time.perf_counter()

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        eta = int(elapsed / self.done * max(self.total - self.done, 0))
        sys.stderr.write(
            f"\r{self.label}: [{bar}] {self.done}/{self.total}  {self.tokens / elapsed:,.0f} tok/s  ETA {eta // 60}:{eta % 60:02d}"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
