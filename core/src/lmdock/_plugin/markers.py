"""The hook markers of the ``lmdock`` pluggy project."""

from __future__ import annotations

import pluggy

#: Marks a plugin's hook implementations: ``@lmdock.hookimpl`` (also ``lmdock.backend.hookimpl``).
hookimpl = pluggy.HookimplMarker("lmdock")
#: Marks the hook specifications (``lmdock.hookspecs``).
hookspec = pluggy.HookspecMarker("lmdock")
