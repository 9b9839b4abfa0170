"""The ``lmdock`` command: the parser over one module per command, and how a run ends.

User mistakes print one clear line and exit 2, never a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from lmdock._cli import backends, batch, chat, config, embed, generate, serve
from lmdock._cli.parser import Parser
from lmdock._plugin.errors import LmdockError

#: The commands, in the order ``lmdock --help`` lists them.
COMMANDS = (backends, generate, chat, batch, embed, serve, config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None:  # the `lmdock` command itself (tests call main([...]) in-process)
        _quiet_engines()
    try:
        code = int(args.func(args) or 0)
    except LmdockError as exc:
        print(f"lmdock: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        return _interrupted(hard=argv is None)
    if argv is None:
        # The command's work is done: a Ctrl-C landing now could only interrupt the interpreter's
        # teardown (torch's atexit handlers printed "Exception ignored ... KeyboardInterrupt").
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _interrupted(hard: bool) -> int:
    """Ctrl-C: stop every engine in order, then exit 130.

    The ``with`` blocks have already shut the LLM down as the interrupt unwound; this is the backstop
    for an interrupt that landed while an LLM was being built or closed.  The command then leaves with
    ``os._exit``: an engine's native threads (torch's pools...) must not meet the interpreter's and
    C++'s teardown, which is what aborted with "terminate called without an active exception" (134).
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the shutdown
    llm_module = sys.modules.get("lmdock._llm.lifecycle")
    if llm_module is not None:
        llm_module.shutdown_all()
    if not hard:
        return 130
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(130)


def _quiet_engines() -> None:
    """No transformers "Loading weights" bar or token-length warning, no torchao import chatter, in a
    CLI run (set the variables yourself to see the transformers ones)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # transformers imports torchao when it is installed (lmdock-hf[quant]), which logs the native
    # kernels it cannot load here and a torch pytree deprecation at import: warnings, not errors
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build_parser() -> Parser:
    """The ``lmdock`` parser: each command module adds its subcommand (``add_parser``), in this order."""
    p = Parser(prog="lmdock", description="Run LLMs on any inference engine.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    p.commands = sub.choices
    return p


def _version() -> str:
    from lmdock import __version__

    return f"lmdock {__version__} (Python {sys.version.split()[0]})"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
