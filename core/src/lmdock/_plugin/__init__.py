"""The plugin machinery, the tiny core: the engine contracts, declared backends, the plugin manager and
its hook markers, the built-in plugin, model loading, engine versions, model families and the errors.

See docs/code-map.md."""
