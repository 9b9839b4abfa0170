"""Helpers for the server tests: a real ``lmdock serve`` subprocess on 127.0.0.1, serving stories260K through the hf backend.

The model comes from ``$LMDOCK_MODELS`` (a missing model or package is a failure, not a skip).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

DOCUMENTED = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."
PROMPT_IDS = [1, 403, 407, 261, 378]


def models_dir() -> Path:
    root = os.environ.get("LMDOCK_MODELS")
    assert root, "set LMDOCK_MODELS to the folder holding stories260K (see ../shared/models/README.md)"
    path = Path(root) / "stories260K"
    assert (path / "config.json").is_file(), f"stories260K not found under {root}"
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, server_table: str = "", args: tuple[str, ...] = (), env: dict[str, str | None] | None = None,
                 extra_models: str = "") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp / "lmdock.toml"
        self.config.write_text(
            f'default_model = "stories"\n\n[server]\nport = {self.port}\n{server_table}\n'
            f'[models.stories]\nmodel = "{models_dir()}"\nbackend = "hf"\n'
            '[models.stories.sampling]\ntemperature = 0.0\nmax_new_tokens = 40\n'
            '[models.stories.backends.hf]\nnum_threads = 1\n' + extra_models,
            encoding="utf-8",
        )
        exe = Path(sys.executable).with_name("lmdock")
        self.log = open(tmp / "server.log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([str(exe), "serve", "--config", str(self.config), "--log-level", "warning", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None})
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"lmdock serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"lmdock serve did not become healthy:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stats(self, headers: dict[str, str] | None = None) -> dict[str, int]:
        return httpx.get(f"{self.url}/stats", headers=headers, timeout=5).json()["stories"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


#: the agent routes' template (``/v1/messages``, ``/v1/responses``): each message on its own line and
#: the tools' names, Hermes-style (``<tool_call>``, so the parser is recognized from it), and a thinking
#: span opened unless ``enable_thinking`` is off
AGENT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call one as "
    "<tool_call>.\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}Result {{ m.tool_call_id }}: {{ m.content }}\n"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt and (enable_thinking is not defined or enable_thinking) %}<think>\n{% endif %}"
)
#: the agent tests' tool arguments
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
           "additionalProperties": False}


def agent_server(tmp: Path, template: str = AGENT_TEMPLATE, server_table: str = "") -> Server:
    """stories260K as ``stories`` and as ``thinker`` (``reasoning_parser = "think"``), both with
    ``template`` (:data:`AGENT_TEMPLATE`)."""
    (tmp / "template.jinja").write_text(template, encoding="utf-8")
    thinker = (f'[models.thinker]\nmodel = "{models_dir()}"\nbackend = "hf"\nreasoning_parser = "think"\n'
               '[models.thinker.sampling]\ntemperature = 0.0\nmax_new_tokens = 40\n')
    return Server(tmp, server_table, args=("--chat-template", str(tmp / "template.jinja"), "--model", "stories", "--model", "thinker"),
                  extra_models=thinker)
