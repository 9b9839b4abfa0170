"""The `lmdock` command: the parser and one module per command.

See docs/code-map.md."""
