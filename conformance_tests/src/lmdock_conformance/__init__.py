"""lmdock-conformance: the shared contract tests for lmdock backends (a pytest plugin)."""

__version__ = "0.1.0"
