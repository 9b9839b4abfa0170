"""OpenAI wire shapes shared by `lmdock serve` and `lmdock batch` (so nothing here imports the server).

See docs/code-map.md."""
