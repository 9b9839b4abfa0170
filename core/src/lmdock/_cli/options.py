"""What several commands share: the model flags, opening the model, a chat template file, flag types."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lmdock._cli.parser import Parser


def model_args(p: Parser) -> None:
    p.add_argument("-m", "--model", help="model name in the config file, a local path or a hub id (default: the config's default model)")
    p.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    p.add_argument("--backend", help="backend name or 'auto' (overrides the config file)")


def open_llm(args: argparse.Namespace) -> Any:
    from lmdock._llm.facade import LLM

    return LLM(args.model, backend=args.backend, config=args.config)


def read_template(path: str | None) -> str | None:
    """The text of a ``--chat-template FILE``, or None without one."""
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        from lmdock._plugin.errors import ConfigError

        raise ConfigError(f"cannot read the chat template: {exc.strerror}", source=path) from None


def port(value: str) -> int:
    """A TCP port number, 0 to 65535 (0: any free port)."""
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port: give a number from 0 to 65535")
    return int(value)


def replica_count(value: str) -> int:
    """A replica count, 1 or more."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a replica count: give a number from 1 (1: no Ray)")
    return int(value)
