"""Grammar checks in worker processes: a client's grammar is compiled where a crash costs one process.

See docs/code-map.md."""
