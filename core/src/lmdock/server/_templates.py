"""Chat templates as a server renders them: off the event loop, within a time and a size limit.

A chat template is a program (Jinja), and a request's own ``chat_template`` is a program a client
sends: three nested loops over ``range(100000)`` froze a server that rendered on its event loop, past
SIGTERM (issue 28).  Here every render, the model's template too, runs on a worker thread whose
trace function stops it once ``[server] template_timeout`` has passed (Jinja templates compile to
Python, so a loop without end still runs lines), and its text is refused past
``[server] max_prompt_chars`` before anything tokenizes it.  A request's own template is refused
unless ``[server] trust_request_chat_template`` is on (vLLM's ``--trust-request-chat-template``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from lmdock._config.server import ServerConfig
from lmdock.server._errors import APIError


class TemplateTimeout(BaseException):
    """Raised inside a render that ran past its deadline (a BaseException, so that the renderer's own
    ``except Exception`` does not turn it into a template error)."""


def _with_deadline(render: Callable[[], str], deadline: float) -> str:
    """Run ``render`` on this thread, stopping it at ``deadline`` (``time.monotonic()``)."""

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return trace

    sys.settrace(trace)  # this worker thread only
    try:
        return render()
    finally:
        sys.settrace(None)


async def render_bounded(render: Callable[[], str], settings: ServerConfig) -> str:
    """``render()`` on a worker thread: a 400 naming the limit when it runs past ``template_timeout``
    or returns more than ``max_prompt_chars`` characters."""
    limit = settings.template_timeout
    try:
        text = await asyncio.to_thread(_with_deadline, render, time.monotonic() + limit)
    except TemplateTimeout:
        raise APIError(400, f"the chat template took longer than {limit:g} s to render ([server] template_timeout)",
                       param="chat_template") from None
    if len(text) > settings.max_prompt_chars:
        raise APIError(400, f"the chat template rendered {len(text)} characters, more than {settings.max_prompt_chars} "
                            "([server] max_prompt_chars)", param="messages")
    return text


def check_request_template(template: str | None, settings: ServerConfig) -> None:
    """A request's own ``chat_template`` only where the operator trusts clients with one."""
    if template is not None and not settings.trust_request_chat_template:
        raise APIError(400, "a chat_template in the request is not accepted by this server (a template is a program); "
                            "use the model's, or ask the operator to set [server] trust_request_chat_template = true",
                       param="chat_template")
