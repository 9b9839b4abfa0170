"""``lmdock config check`` and ``lmdock config schema``: the config file validated, or its JSON Schema."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    """``lmdock config``'s flags."""
    cfg = sub.add_parser("config", help="check the config file or print its JSON Schema")
    csub = cfg.add_subparsers(metavar="ACTION")
    ck = csub.add_parser("check", help="validate the config file, with every installed backend's options")
    ck.add_argument("--config", help="config file (default: $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    ck.set_defaults(func=check)
    sc = csub.add_parser("schema", help="print the config file's JSON Schema (for editors)")
    sc.set_defaults(func=schema)
    cfg.set_defaults(func=lambda a: cfg.print_help() or 2)


def check(args: argparse.Namespace) -> int:
    from lmdock._config.file import find_config, load_config
    from lmdock._config.schema import build
    from lmdock._plugin.manager import get_registry

    path = find_config(args.config)
    if path is None:
        from lmdock._plugin.errors import ConfigError

        raise ConfigError("no config file found (looked for --config, $LMDOCK_CONFIG, ./lmdock.toml, ~/.config/lmdock/lmdock.toml)")
    cfg = load_config(path)
    reg = get_registry()
    notes = []
    for name, mc in cfg.models.items():
        for bname, opts in mc.backends.items():
            spec = reg.backends.get(bname)
            if spec is None:
                notes.append(f"models.{name}.backends.{bname}: backend not installed here; its options were not checked")
            elif spec.options is not None:
                build(spec.options, opts, source=cfg.path, prefix=f"models.{name}.backends.{bname}")
    print(f"{cfg.path}: OK ({len(cfg.models)} model{'s' if len(cfg.models) != 1 else ''}: {', '.join(cfg.models)})")
    for n in notes:
        print(f"note: {n}")
    return 0


def schema(args: argparse.Namespace) -> int:
    from lmdock._config.file import config_schema
    from lmdock._plugin.manager import get_registry

    options = {s.name: s.options for s in get_registry().backends.values() if s.options is not None}
    print(json.dumps(config_schema(options), indent=2))
    return 0
