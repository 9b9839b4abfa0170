"""The configuration types and where they come from: sampling and model/server configs, the TOML file,
strict construction from plain data, JSON schemas, request fields and the one table of foreign names.

See docs/code-map.md."""
