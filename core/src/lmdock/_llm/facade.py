"""The ``LLM`` facade: one API over every backend, step or request engine."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from lmdock._config.file import SERVE_ONLY_KEYS
from lmdock._config.foreign import constructor_options
from lmdock._config.sampling import EditableSamplingParams, SamplingParams, StructuredOutput
from lmdock._engine.adapters import as_request_engine
from lmdock._engine.request_engine import RequestEngineBase
from lmdock._llm import lifecycle
from lmdock._llm.chat import ChatCall, chat_plan, render_chat
from lmdock._llm.embed import PoolingArg, PoolingCalls
from lmdock._llm.lora import LoRAArg, lora_per_prompt
from lmdock._llm.multimodal import PYTHON_LIMITS
from lmdock._llm.outputs import EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
from lmdock._llm.prompts import Prompt, as_batch, content_as, indexed, token_id_prompts
from lmdock._llm.requests import ParamsArg, default_params, engine_request, resolve_params, run_batch
from lmdock._llm.streams import RequestFuture, RequestStream, submit_from_loop
from lmdock._plugin.contract import EngineRequest, RequestEngine
from lmdock._plugin.errors import ConfigError, RequestError, UnsupportedError
from lmdock._plugin.loader import load_engine, resolve_model

if TYPE_CHECKING:
    from lmdock._config.model import ModelConfig
    from lmdock._plugin.contract import BackendSpec

class LLM:
    """A model on a backend, ready to generate.

    :param model: a model name from the config file, a local path, or a hub id.
    :param backend: a backend name, or ``"auto"``; overrides the config file's choice.
    :param config: the config file; by default found as ``lmdock config check`` explains.
    :param options: the keys of a ``[models.NAME]`` table (``build={"dtype": "float32"}``,
        ``quantization=QuantConfig(...)``, ``sampling={...}``, ``backends={"hf": {...}}``...),
        applied over the config file's entry; vLLM's, TensorRT-LLM's and furiosa-llm's own arguments
        (``dtype=``, ``max_model_len=``, ``build_config=``, ``artifact_path=``...) are read as the keys they
        mean, or refused with lmdock's equivalent (``lmdock._config.foreign``, docs/migrating.md).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        backend: str | None = None,
        config: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        self._setup(model, backend, config, options, load_engine)

    @classmethod
    def over_engine(cls, model: str | os.PathLike[str] | None,
                    engine: Callable[[ModelConfig], tuple[RequestEngine, BackendSpec]],
                    backend: str | None = None, config: str | os.PathLike[str] | None = None, **options: Any) -> LLM:
        """An ``LLM`` whose engine ``engine(model_config)`` gives in place of a backend loading one here:
        ``lmdock serve --replicas`` gives its front end the replicas' engine so, the model loaded only
        in the replicas (``server/_ray.py``)."""
        llm = cls.__new__(cls)
        llm._setup(model, backend, config, options, engine)
        return llm

    def _setup(self, model: str | os.PathLike[str] | None, backend: str | None, config: str | os.PathLike[str] | None,
               options: dict[str, Any], load: Callable[[ModelConfig], tuple[RequestEngine, BackendSpec]]) -> None:
        self._engine: RequestEngineBase | None = None
        self._grammar_check: Any = None
        self.image_limits = PYTHON_LIMITS  # bounds on prompts' images (lmdock serve sets [server]'s)
        model, options, after = constructor_options(model, options)
        serve_only = [k for k in SERVE_ONLY_KEYS if k in options]
        if serve_only:
            raise ConfigError(f"{', '.join(serve_only)}: Ray Serve replicas are lmdock serve's (--replicas, or these keys "
                              "in the config file, docs/scale-out.md); an LLM runs one engine in this process")
        if backend is not None:
            options["backend"] = backend
        self.model_config = resolve_model(model, config, options)
        engine, self.backend = load(self.model_config)
        self._engine = as_request_engine(engine)  # over_engine's own (load_engine's already is)
        lifecycle.live.add(self)
        self.tokenizer = self._engine.tokenizer
        self.max_model_len = self._engine.max_seq_len
        self._defaults = self._default_params()
        after.apply(self)

    def shutdown(self) -> None:
        """Stop the engine and free its memory.  Idempotent."""
        engine, self._engine = self._engine, None
        lifecycle.live.discard(self)
        if engine is not None:
            engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:  # best effort; shutdown() is the contract
        try:
            self.shutdown()
        except Exception:
            pass

    @property
    def engine(self) -> RequestEngineBase:
        if self._engine is None:
            from lmdock._plugin.errors import EngineClosedError

            raise EngineClosedError("this LLM was shut down; create a new one")
        return self._engine

    def stats(self) -> dict[str, Any]:
        """The engine's live counts (``num_requests_running``, ``num_requests_waiting``,
        ``kv_cache_usage_perc``, ``num_preemptions_total``, ``num_sequences_held``; a step engine also
        ``num_requests_aborted_total``, requests ended by a cancel or a client gone), or ``{}`` when
        the engine reports none."""
        return dict(self.engine.stats())

    # -- sampling defaults ----------------------------------------------------------------------

    def get_default_sampling_params(self) -> EditableSamplingParams:
        """The parameters used when a call passes none: generation_config.json, then the config file.
        An editable copy (vLLM's habit: ``sp = llm.get_default_sampling_params(); sp.max_tokens = 40``):
        each assignment is validated, and changing it changes no later call's defaults."""
        return self._defaults.clone()

    def get_tokenizer(self) -> Any:
        """The tokenizer prompts are encoded with (vLLM's ``get_tokenizer``); None without one."""
        return self.tokenizer

    def _default_params(self) -> SamplingParams:
        return default_params(self.engine.generation_config, self.model_config)

    def sampling_params(self, overrides: ParamsArg = None) -> SamplingParams:
        """The SamplingParams a call given ``overrides`` runs with: a dict's SamplingParams fields over
        :meth:`get_default_sampling_params` (a front end maps OpenAI's names first, through
        ``lmdock._config.foreign.OPENAI_FIELDS``); complete SamplingParams as they are; None, the defaults.
        Raises ConfigError naming the field for a value out of range or an unknown field."""
        return self._params(overrides)

    def _params(self, params: ParamsArg) -> SamplingParams:
        return resolve_params(self._defaults, params)

    # -- requests -------------------------------------------------------------------------------

    def check_grammar(self, params: SamplingParams) -> None:
        """Check ``params.structured_output`` in a grammar-check worker process (compiled, its first
        steps run, under a deadline; the verdict cached per grammar): raise :class:`lmdock.GrammarError`
        naming why it cannot run.  Every request is checked before it is submitted; call this first
        to have the check's wait (a fresh grammar: milliseconds to seconds) where you want it."""
        if params.structured_output is not None:
            self._grammars().check(params.structured_output)

    async def acheck_grammar(self, params: SamplingParams) -> None:
        """:meth:`check_grammar` for an event loop (the check runs on a thread); ``lmdock serve``
        awaits it before it submits, so its loop never waits for a compile."""
        if params.structured_output is not None and self.backend.capability("structured_output")[0]:
            await self._grammars().acheck(params.structured_output)

    def _grammars(self) -> Any:
        from lmdock._grammar.check import GrammarCheck

        if self._grammar_check is None:  # the tokenizer is read on the first structured request
            self._grammar_check = GrammarCheck(self.tokenizer)
        return self._grammar_check

    def make_request(self, prompt: Prompt, sampling_params: ParamsArg = None, *, stream: bool = False,
                     add_special_tokens: bool = True, lora_request: LoRAArg = None) -> EngineRequest:
        """The engine request a call would submit, for a caller that streams it on an event loop
        (:meth:`open_stream`, as ``lmdock serve`` does) or drives :attr:`engine` itself:
        ``llm.engine.submit(request, sink)``, then ``llm.engine.abort(request.request_id)`` if it stops
        listening first.

        The prompt is tokenized (``add_special_tokens``: the tokenizer's BOS and such, off for a
        rendered chat template that holds them) and checked; ``stream``: the engine sends every
        snapshot, not only the last; ``lora_request``: the adapter to run under.  Raises RequestError or
        ConfigError as :meth:`generate` would."""
        (lora,) = lora_per_prompt(lora_request, 1, self.model_config.adapters)
        return engine_request(self, prompt, self._params(sampling_params), stream, add_special_tokens, lora_request=lora)

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RequestError(f"backend {self.backend.name!r} was loaded without a tokenizer; pass token ids")
        return self.tokenizer

    def _submit(self, request: EngineRequest) -> RequestFuture:
        future = RequestFuture(request.request_id, self.engine.abort, streaming=request.stream)
        self.engine.submit(request, future)
        return future

    async def open_stream(self, request: EngineRequest, *, merge: bool = True,
                          skipped: Callable[[RequestOutput], Any] | None = None) -> RequestStream:
        """Submit ``request`` (from :meth:`make_request`, ``stream=True``) from an event loop: its
        :class:`RequestStream`, read with ``async for``; leaving the loop early or ``close()`` aborts
        it.  What ``lmdock serve`` reads every request from.  A LoRA adapter is read from disk off the
        loop on first use, and a request with a grammar is submitted on a thread, where the engine
        compiles it.  ``merge`` and ``skipped``: as :class:`RequestStream`'s (snapshots that wait for
        a slow reader are merged into the newest)."""
        engine = self.engine
        if request.lora_request is not None:  # reads the adapter from disk on first use
            await asyncio.to_thread(engine.prepare_lora, request.lora_request)
        stream = RequestStream(request.request_id, engine.abort, merge=merge, skipped=skipped)
        await submit_from_loop(engine, request, stream)
        return stream

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: ParamsArg | Sequence[ParamsArg] = None,
        *,
        use_tqdm: bool | None = None,
        prompt_token_ids: Any = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        lora_request: LoRAArg | Sequence[LoRAArg] = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a batch; returns one ``RequestOutput`` per prompt, in order.

        A prompt is text, a list of token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids":
        [...]}`` dict.  ``sampling_params`` is one for all prompts or a list with one per prompt; a dict
        overrides fields of :meth:`get_default_sampling_params`.  furiosa-llm's ``prompt_token_ids`` (a
        ``BatchEncoding`` or lists of ids) replaces the prompts' tokenization; ``tokenizer_kwargs`` go
        to the tokenizer's ``encode``.  ``lora_request`` (a :class:`LoRARequest` or the name of an
        adapter in ``[models.NAME.adapters]``; one, or one or None per prompt) runs prompts under LoRA
        adapters, on a backend that declares ``lora``.
        """
        batch = token_id_prompts(prompt_token_ids, prompts)
        plist = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(batch)
        if len(plist) != len(batch):
            raise RequestError(f"got {len(plist)} sampling_params for {len(batch)} prompts")
        loras = lora_per_prompt(lora_request, len(batch), self.model_config.adapters)
        requests = [indexed(i, len(batch), engine_request, self, p, self._params(sp), tokenizer_kwargs=tokenizer_kwargs, lora_request=lr)
                    for i, (p, sp, lr) in enumerate(zip(batch, plist, loras))]
        return self._run_batch(requests, use_tqdm)

    def _run_batch(self, requests: list[EngineRequest], use_tqdm: bool | None) -> list[RequestOutput]:
        scheduler = self.model_config.scheduler
        return run_batch(self._submit, requests, max(1, scheduler.max_waiting // 2 + scheduler.max_num_seqs), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: ParamsArg = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        use_tqdm: bool | None = None,
        chat_template_content_format: str = "auto",
        lora_request: LoRAArg | Sequence[LoRAArg] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.

        ``tools`` (OpenAI's function tools) are rendered by the template; with a tool parser (the
        config's ``tool_parser``, or one recognized from the template) each completion's
        ``tool_calls`` holds the calls it made and ``content`` the rest; ``tool_choice``
        (``"auto"``, ``"none"``, ``"required"`` or a named function) and ``parallel_tool_calls`` as
        OpenAI's.  A reasoning parser moves thinking into ``reasoning_content``.  See docs/tools.md.

        ``chat_template_content_format`` (vLLM's, furiosa-llm's): ``"string"`` joins a message's list of
        text parts into one string before the template sees it; ``"openai"`` and ``"auto"`` pass it as is.
        ``lora_request``: as :meth:`generate`'s, one or one per conversation."""
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message=True needs add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        conversations = [content_as(chat_template_content_format, conv) for conv in conversations]  # type: ignore[arg-type]
        params = self._params(sampling_params)
        loras = lora_per_prompt(lora_request, len(conversations), self.model_config.adapters)
        calls, requests = [], []
        for i, (conv, lora) in enumerate(zip(conversations, loras)):
            call = ChatCall(self, conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                            tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, lora_request=lora)
            call.render()
            requests.append(indexed(i, len(conversations), call.request, call.constrain(params)))
            calls.append(call)
        return [call.read(out) for call, out in zip(calls, self._run_batch(requests, use_tqdm))]

    def chat_plan(self, tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                  chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> Any:
        """How a chat request with these fields treats tools and thinking (a :class:`lmdock.tools.ChatPlan`),
        with this model's parsers; RequestError naming the field that cannot be honoured."""
        return chat_plan(self, tools, tool_choice, parallel_tool_calls, chat_template, chat_template_kwargs)

    def constrained(self, params: SamplingParams, plan: Any) -> SamplingParams:
        """``params`` with the structured output that keeps ``plan``'s calls valid, where it needs one."""
        so = plan.constraint(self.backend.capability("tools"), params.structured_output, self.backend.name)
        return params if so is None else params.replace(structured_output=StructuredOutput(**so))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text a conversation becomes (``tools``: the template's ``tools`` variable, as
        transformers' ``apply_chat_template(tools=...)``)."""
        return render_chat(self, messages, chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs, tools)

    def generate_async(self, prompt: Prompt, sampling_params: ParamsArg = None, streaming: bool = False,
                       lora_request: LoRAArg = None) -> RequestFuture:
        """Submit one request; returns a future: ``.result(timeout)``, ``await fut`` (or ``.aresult()``),
        ``.cancel()``, and ``async for out in fut``, which yields every cumulative snapshot with
        ``streaming=True`` (TensorRT-LLM's), else the final output once."""
        (lora,) = lora_per_prompt(lora_request, 1, self.model_config.adapters)
        return self._submit(engine_request(self, prompt, self._params(sampling_params), stream=streaming, lora_request=lora))

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: Any, *, use_tqdm: bool | None = None) -> list[Any]:
        """vLLM's ``LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens, ...))``: one
        ``BeamSearchOutput`` per prompt, whose ``sequences`` (best first) hold the prompt's and the
        beam's tokens, their text, and ``cum_logprob``.  Runs lmdock's beam search (``beam_width``)."""
        from lmdock._llm.beam_search import beam_search

        return beam_search(self, prompts, params, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: ParamsArg = None, lora_request: LoRAArg = None) -> Iterator[RequestOutput]:
        """Yield cumulative snapshots of one request as it runs (synchronous); the last is finished.

        With ``n > 1`` each snapshot holds every completion (``out.outputs[i]``, by ``index``)."""
        (lora,) = lora_per_prompt(lora_request, 1, self.model_config.adapters)
        request = engine_request(self, prompt, self._params(sampling_params), stream=True, lora_request=lora)
        stream = RequestStream(request.request_id, self.engine.abort, alive=lambda: self._engine is not None)
        self.engine.submit(request, stream)
        yield from stream

    async def stream_generate(self, prompt: Prompt, sampling_params: ParamsArg = None, prompt_token_ids: Any = None,
                              tokenizer_kwargs: dict[str, Any] | None = None, lora_request: LoRAArg = None) -> AsyncIterator[str]:
        """Yield text deltas of one request as they are generated (furiosa-llm's ``stream_generate``).

        The deltas join to exactly the text ``generate`` returns.  Closing the generator (or
        cancelling the task) aborts the request and frees its state at once.  It streams one
        completion: for ``n > 1`` use :meth:`stream`, whose snapshots hold every completion.
        """
        params = self._params(sampling_params)
        if params.n > 1:
            raise RequestError(f"stream_generate yields the text of one completion, and n={params.n} asks for more: "
                               "use LLM.stream(prompt, params), whose snapshots hold every completion (outputs[i])")
        (prompt,) = token_id_prompts(prompt_token_ids, prompt, one=True)
        (lora,) = lora_per_prompt(lora_request, 1, self.model_config.adapters)
        request = engine_request(self, prompt, params, stream=True, tokenizer_kwargs=tokenizer_kwargs, lora_request=lora)
        stream = RequestStream(request.request_id, self.engine.abort)
        self.engine.submit(request, stream)
        sent = 0
        try:
            async for out in stream:
                text = out.outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
        finally:
            stream.close()

    # -- next-token logprobs (genlm-backend's AsyncLM) --------------------------------------------

    def _logprob_future(self, token_ids: Sequence[int]) -> Any:
        """The engine's future for one prefix; an engine without the member is refused with its
        backend's reason."""
        try:
            return self.engine.next_token_logprobs(token_ids)
        except UnsupportedError as exc:
            _, reason = self.backend.capability("next_token_logprobs")
            raise UnsupportedError(f"backend {self.backend.name!r} has no next_token_logprobs: {reason}") from exc

    async def next_token_logprobs(self, token_ids: Sequence[int]) -> Any:
        """Log-probabilities (NumPy float32, shape [vocab]) of the token that follows ``token_ids``.

        Concurrent calls are batched together; a prefix cache reuses results and KV state.
        """
        return await asyncio.wrap_future(self._logprob_future(token_ids))

    def next_token_logprobs_sync(self, token_ids: Sequence[int]) -> Any:
        """Blocking :meth:`next_token_logprobs`."""
        return self._logprob_future(token_ids).result()

    async def batch_next_token_logprobs(self, token_ids_list: Sequence[Sequence[int]]) -> Any:
        """Next-token logprobs for several prefixes at once: shape [len(token_ids_list), vocab]."""
        import numpy as np

        futures = [asyncio.wrap_future(self._logprob_future(ids)) for ids in token_ids_list]
        return np.stack(await asyncio.gather(*futures))

    def batch_next_token_logprobs_sync(self, token_ids_list: Sequence[Sequence[int]]) -> Any:
        """Blocking :meth:`batch_next_token_logprobs`."""
        import numpy as np

        futures = [self._logprob_future(ids) for ids in token_ids_list]
        return np.stack([f.result() for f in futures])

    def clear_cache(self) -> None:
        """Drop the prefix caches (next-token logprobs, and automatic prefix caching of prompts) and
        the KV state they hold.  A no-op for engines that keep no such cache."""
        self.engine.clear_cache()

    # -- embeddings and scoring (furiosa-llm's / vLLM's embed and score) -----------------------

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingArg | Sequence[PoolingArg] = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in order: ``outputs[i].outputs.embedding``.

        ``pooling_params`` is one for all prompts or one per prompt; its None fields take the model's
        pooling and normalization (its sentence-transformers files), then ``[models.NAME.pooling]``.
        Prompts from concurrent calls are computed together in batches.
        """
        return self._pooling("embed").embed(as_batch(prompts), pooling_params)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingArg = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs, 1 -> 1, 1 -> N (``text_1`` paired with each of ``text_2``) or N -> N.

        A cross-encoder (a sequence classifier with one label) reads each pair together and the score
        is the sigmoid of its logit, as sentence-transformers' ``CrossEncoder.predict``; an embedding
        model gives the cosine similarity of the two embeddings.
        """
        return self._pooling("score").score(text_1, text_2, truncate_prompt_tokens, pooling_params)

    def _pooling(self, capability: str) -> PoolingCalls:
        engine = self.engine
        if engine.kind == "pooling":
            return PoolingCalls(engine, self._tokenizer, self.model_config)
        ok, reason = self.backend.capability(capability)
        if not ok:
            raise UnsupportedError(f"backend {self.backend.name!r} has no {capability}: {reason}")
        raise UnsupportedError(f"model {self.model_config.model!r} was loaded for generation; {capability} needs an embedding "
                               "model (a BERT-style encoder or a sentence-transformers folder) or a cross-encoder")
