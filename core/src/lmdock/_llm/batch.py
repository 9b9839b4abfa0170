"""``lmdock batch INPUT.jsonl OUTPUT.jsonl``: OpenAI batch files, run offline.

The lines (read and checked by ``_batch_lines``) run concurrently on one LLM: completions and chat
through ``LLM.generate_async`` (continuous batching), embeddings through ``LLM.embed`` on worker
threads (the pooling runner batches their calls together).  Each output line is ``{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, as OpenAI's batch output
is, its body what ``lmdock serve`` answers (logprobs and embeddings in the same shapes, from the same
``lmdock._llm.logprobs`` and ``lmdock._openai.embeddings``), appended and flushed as each request
finishes: an interrupted run loses nothing already done, and a rerun skips the custom_ids OUTPUT holds.

A line that cannot run becomes an error line (``"response": null, "error": {"code", "message"}``).
A model that cannot serve a kind of line at all (chat lines and no chat template, embeddings on a
generative model) stops the run with one error instead: error lines for those would stand in the way
of the rerun that fixes it (a rerun skips them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from lmdock._llm.logprobs import chat_logprobs, legacy_logprobs
from lmdock._llm.progress import Progress
from lmdock._openai.batch_lines import Line, LineError, Request, done_ids, parse_request, read_lines, sampling_overrides
from lmdock._openai.embeddings import embedding_prompts, embeddings_response
from lmdock._plugin.errors import LmdockError, UnsupportedError

#: Requests in flight at once (the rest of the file waits, so a huge file does not fill the queue).
WINDOW = 256
#: Threads running embeddings lines (each waits on LLM.embed; the pooling runner batches them).
EMBED_THREADS = 8


def run_batch(args: argparse.Namespace, chat_template: str | None = None) -> int:
    """Run INPUT's lines not yet in OUTPUT; 0 when all ran, 1 when some became error lines.
    ``chat_template``: the text of ``--chat-template``, used for every chat line."""
    from lmdock._llm.facade import LLM

    src, dst = Path(args.input), Path(args.output)
    done = done_ids(dst)
    todo = [line for line in read_lines(src) if line.custom_id not in done]
    if not todo:
        print(f"lmdock batch: every line of {src} already has its result in {dst}", file=sys.stderr)
        return 0
    requests = [_parse(line) for line in todo]
    progress = Progress(len(todo), not args.no_progress and sys.stderr.isatty(), label="Requests")
    with LLM(args.model, backend=args.backend, config=args.config) as llm, dst.open("a", encoding="utf-8") as out:
        runner = _Runner(llm, out, chat_template, progress)
        runner.check_chat_template(todo, requests)
        with concurrent.futures.ThreadPoolExecutor(EMBED_THREADS, thread_name_prefix="lmdock-batch-embed") as pool:
            runner.run(todo, requests, pool)
    if runner.failed:
        print(f"lmdock batch: {runner.failed} of {len(todo)} lines failed; see their error lines in {dst}", file=sys.stderr)
    return 1 if runner.failed else 0


def _parse(line: Line) -> Request | LineError:
    try:
        return parse_request(line)
    except LineError as exc:
        return exc


class _Runner:
    """The lines of one run in flight on ``llm``, each result written to ``out`` as it finishes."""

    def __init__(self, llm: Any, out: TextIO, chat_template: str | None, progress: Progress) -> None:
        self.llm, self.out, self.chat_template, self.progress = llm, out, chat_template, progress
        self.model = llm.model_config.name or llm.model_config.model
        self.pending: dict[concurrent.futures.Future[Any], tuple[Line, Request]] = {}
        self.failed = 0
        self.stopped: UnsupportedError | None = None  # the model cannot serve a kind of line: no more are submitted

    def check_chat_template(self, lines: list[Line], requests: list[Request | LineError]) -> None:
        """Chat lines need a template: ``--chat-template`` or the model's own (checked before any runs)."""
        chats = [line.lineno for line, r in zip(lines, requests) if isinstance(r, Request) and r.url == "/v1/chat/completions"]
        tok = self.llm.tokenizer
        if chats and self.chat_template is None and tok is not None and not getattr(tok, "chat_template", None):
            shown = ", ".join(map(str, chats[:5])) + (f" and {len(chats) - 5} more" if len(chats) > 5 else "")
            raise LmdockError(f"model {self.llm.model_config.model!r} has no chat template for the /v1/chat/completions "
                              f"lines (line {shown}): pass --chat-template FILE (a Jinja template); nothing was run")

    def run(self, lines: list[Line], requests: list[Request | LineError], pool: concurrent.futures.Executor) -> None:
        """Submit the lines (WINDOW in flight at most) and write every result; when the model cannot
        serve a kind of line, the lines in flight still finish and are written, then that error is raised."""
        try:
            for line, request in zip(lines, requests):
                while len(self.pending) >= WINDOW:
                    self.drain()
                if self.stopped is not None:
                    break
                if isinstance(request, LineError):
                    self.write_error(line, request.code, str(request))
                    continue
                try:
                    self.pending[self.submit(request, pool)] = (line, request)
                except UnsupportedError as exc:
                    self.stopped = _cannot(line, request, exc)
                except LmdockError as exc:
                    self.write_error(line, "invalid_request", str(exc))
            while self.pending:
                self.drain()
        except BaseException:
            for fut in self.pending:
                fut.cancel()
            raise
        if self.stopped is not None:
            raise self.stopped

    def submit(self, request: Request, pool: concurrent.futures.Executor) -> concurrent.futures.Future[Any]:
        llm, body = self.llm, request.body
        if request.url == "/v1/embeddings":
            from lmdock._config.pooling import PoolingParams
            from lmdock._config.schema import build

            fields = {k: body[k] for k in ("dimensions", "truncate_prompt_tokens") if body.get(k) is not None}
            pooling = build(PoolingParams, fields, source="<line>", prefix="body") if fields else None
            return pool.submit(llm.embed, embedding_prompts(body["input"]), pooling)
        params = llm.sampling_params(sampling_overrides(request))
        if request.url == "/v1/chat/completions":
            text = llm.render_chat(body["messages"], self.chat_template, body.get("add_generation_prompt", True),
                                   bool(body.get("continue_final_message")), body.get("chat_template_kwargs"))
            prompt: Any = llm.tokenizer.encode(text, add_special_tokens=False)  # the template wrote BOS
        else:
            prompt = body["prompt"]
        return llm.generate_async(prompt, params)  # type: ignore[no-any-return]

    def drain(self) -> None:
        """Write the results that have finished (at least one)."""
        finished, _ = concurrent.futures.wait(list(self.pending), return_when=concurrent.futures.FIRST_COMPLETED)
        for fut in finished:
            line, request = self.pending.pop(fut)
            try:
                result = fut.result()
            except UnsupportedError as exc:
                self.stopped = self.stopped or _cannot(line, request, exc)
                continue
            except LmdockError as exc:
                self.write_error(line, "request_failed", str(exc))
                continue
            if request.url == "/v1/embeddings":
                fmt = request.body.get("encoding_format") or "float"
                body, request_id, tokens = embeddings_response(result, self.model, fmt), result[0].request_id, 0
            else:
                body, request_id = self.completion_body(request, result), result.request_id
                tokens = sum(len(c.token_ids) for c in result.outputs)
            self.write({"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
                        "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None})
            self.progress.update(tokens)

    def completion_body(self, request: Request, out: Any) -> dict[str, Any]:
        """The body ``lmdock serve`` answers for one prompt (its choices, logprobs as the server writes them)."""
        tok, k, chat = self.llm.tokenizer, request.logprobs, request.url == "/v1/chat/completions"
        context = list(out.prompt_token_ids or [])  # what the first token's text follows
        choices = []
        for c in out.outputs:
            ids, positions = list(c.token_ids), list(c.logprobs or [])
            if chat:
                lp = None if k is None else {"content": chat_logprobs(tok, ids, positions, k, context)}
                choice: dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": c.text}}
            else:
                lp = None if k is None else legacy_logprobs(tok, ids, positions, 0, context)
                choice = {"index": c.index, "text": c.text}
            choices.append({**choice, "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        prompt_tokens, completion_tokens = len(context), sum(len(c.token_ids) for c in out.outputs)
        return {"id": out.request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()

    def write_error(self, line: Line, code: str, message: str) -> None:
        self.write({"id": None, "custom_id": line.custom_id, "response": None,
                    "error": {"code": code, "message": f"line {line.lineno}: {message}"}})
        self.failed += 1
        self.progress.update(0)


def _cannot(line: Line, request: Request, exc: UnsupportedError) -> UnsupportedError:
    """The run's error when the model cannot serve a kind of line at all (the lines done stay in OUTPUT)."""
    return UnsupportedError(f"line {line.lineno} ({request.url}): {exc}; run the {request.url} lines with a model "
                            "that serves them (-m MODEL); the results written stay in OUTPUT and a rerun skips them")
