"""Several models in one process: the model pool, its memory accounting and Ray Serve replica counts.

See docs/code-map.md."""
