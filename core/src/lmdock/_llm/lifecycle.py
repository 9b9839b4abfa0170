"""The LLMs alive in this process, shut down at interpreter exit (and by the CLI on Ctrl-C) before
engine threads are torn away: an engine thread killed mid-step can leave native resources behind
(MLX streams, for one)."""

from __future__ import annotations

import atexit
import weakref
from typing import Any

#: LLMs not yet shut down
live: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def shutdown_all() -> None:
    """Shut every live LLM down (at interpreter exit; the CLI on Ctrl-C)."""
    for llm in list(live):
        try:
            llm.shutdown()
        except Exception:  # noqa: BLE001 - one LLM's failure must not keep the others up
            pass
