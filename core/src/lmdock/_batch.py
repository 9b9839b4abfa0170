"""``lmdock batch INPUT.jsonl OUTPUT.jsonl``: OpenAI batch files, run offline.

Each input line is ``{"custom_id": ..., "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {"prompt": ... | "messages": [...], sampling fields...}}`` (``method``
and ``url`` are optional: the body's ``prompt`` or ``messages`` says which).  Each output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, as OpenAI's batch
output is, appended and flushed as each request finishes: an interrupted run loses nothing already
done, and a rerun skips the ``custom_id`` values OUTPUT already holds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path
from typing import Any

from lmdock._errors import ConfigError, LmdockError
from lmdock._params import OPENAI_FIELDS
from lmdock._progress import Progress

#: Body fields accepted and not used: the model is the command's (-m), the output is never streamed.
_IGNORED = {"model", "user", "stream"}
_URLS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
#: Requests in flight at once (the rest of the file waits, so a huge file does not fill the queue).
WINDOW = 256


class LineError(Exception):
    """One input line cannot run; it becomes an error line and the others carry on."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


def done_ids(output: Path) -> set[str]:
    """The custom_id values OUTPUT already holds (a torn last line, from a killed run, is ignored)."""
    ids: set[str] = set()
    if not output.exists():
        return ids
    with output.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("custom_id"), str):
                ids.add(record["custom_id"])
    return ids


def parse_line(lineno: int, line: str) -> tuple[str, str, dict[str, Any]]:
    """``(custom_id, kind, body)`` of one input line; kind is ``prompt`` or ``messages``."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise LineError("invalid_json", f"line {lineno}: not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise LineError("invalid_request", f"line {lineno}: expected a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("invalid_request", f"line {lineno}: missing custom_id (a non-empty string)")
    body = record.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "missing body (an object with prompt or messages)", custom_id)
    url = record.get("url")
    if url is not None and url not in _URLS:
        raise LineError("invalid_url", f"url {url!r} is not supported; use {' or '.join(_URLS)}", custom_id)
    kind = _URLS.get(url) if url else ("messages" if "messages" in body else "prompt")
    if kind not in body:
        raise LineError("invalid_request", f"body has no {kind!r}", custom_id)
    return custom_id, kind, body


def sampling_overrides(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The body's sampling fields as SamplingParams overrides; an unknown field is this line's error."""
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key == kind or key in _IGNORED or value is None:
            continue
        if key not in OPENAI_FIELDS:
            import difflib

            close = difflib.get_close_matches(key, list(OPENAI_FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; supported: {', '.join(sorted(OPENAI_FIELDS))}"
            raise LineError("invalid_request", f"body field {key!r} is not supported{hint}")
        out[OPENAI_FIELDS[key]] = value
    return out


def _result(custom_id: str, kind: str, model: str, out: Any, n: int) -> dict[str, Any]:
    prompt_tokens = len(out.prompt_token_ids or [])
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    if kind == "messages":
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
                   for c in out.outputs]
        obj = "chat.completion"
    else:
        choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason} for c in out.outputs]
        obj = "text_completion"
    body = {"id": out.request_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return {"id": f"batch_req_{out.request_id}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": out.request_id, "body": body}, "error": None}


def _error(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {"id": None, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def run_batch(args: argparse.Namespace) -> int:
    from lmdock._llm import LLM

    src, dst = Path(args.input), Path(args.output)
    try:
        lines = src.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the batch input: {exc.strerror}", source=str(src)) from None
    skip = done_ids(dst)
    todo = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    ids_seen: set[str] = set()
    failed = 0
    with LLM(args.model, backend=args.backend, config=args.config) as llm, dst.open("a", encoding="utf-8") as out_file:
        def write(record: dict[str, Any]) -> None:
            out_file.write(json.dumps(record, ensure_ascii=False) + "\n")
            out_file.flush()

        model = llm.model_config.name or llm.model_config.model
        jobs: list[tuple[int, str]] = []
        for lineno, line in todo:
            try:
                custom_id = json.loads(line).get("custom_id")
            except (ValueError, AttributeError):
                custom_id = None
            if isinstance(custom_id, str) and custom_id in skip:
                continue
            jobs.append((lineno, line))
        progress = Progress(len(jobs), not args.no_progress and sys.stderr.isatty() and len(jobs) > 0, label="Requests")
        pending: dict[concurrent.futures.Future[Any], tuple[str, str, int]] = {}
        try:
            for lineno, line in jobs:
                while len(pending) >= WINDOW:
                    failed += _drain(pending, write, progress, model, first=True)
                custom_id: str | None = None
                try:
                    custom_id, kind, body = parse_line(lineno, line)
                    if custom_id in ids_seen:
                        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appears twice in the input")
                    ids_seen.add(custom_id)
                    params = llm.sampling_params(sampling_overrides(body, kind))
                    if kind == "messages":
                        text = llm.render_chat(body["messages"])
                        prompt: Any = llm.tokenizer.encode(text, add_special_tokens=False)
                    else:
                        prompt = body["prompt"]
                        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                            prompt = prompt[0]
                    fut = llm.generate_async(prompt, params)
                except LineError as exc:
                    write(_error(custom_id or exc.custom_id, exc.code, str(exc)))
                    failed += 1
                    progress.update(0)
                    continue
                except LmdockError as exc:
                    write(_error(custom_id, "invalid_request", str(exc)))
                    failed += 1
                    progress.update(0)
                    continue
                pending[fut] = (custom_id, kind, params.n)
            while pending:
                failed += _drain(pending, write, progress, model, first=False)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    if failed:
        print(f"lmdock batch: {failed} of {len(jobs)} lines failed; see their error lines in {dst}", file=sys.stderr)
    return 0 if not failed else 1


def _drain(pending: dict[Any, tuple[str, str, int]], write: Any, progress: Progress, model: str, first: bool) -> int:
    """Write the results that have finished (at least one); returns how many were errors."""
    done, _ = concurrent.futures.wait(list(pending), return_when=concurrent.futures.FIRST_COMPLETED)
    failed = 0
    for fut in done:
        custom_id, kind, n = pending.pop(fut)
        try:
            out = fut.result()
        except LmdockError as exc:
            write(_error(custom_id, "request_failed", str(exc)))
            failed += 1
            progress.update(0)
            continue
        write(_result(custom_id, kind, model, out, n))
        progress.update(sum(len(c.token_ids) for c in out.outputs))
    return failed
