"""The hook specifications of lmdock, in lifecycle order.

Plugins implement these with ``@lmdock.hookimpl`` and register through the ``lmdock`` entry-point
group.  The core's own defaults (the FCFS scheduler, the reference sampler) are ordinary plugins in
``lmdock._plugin.builtin``: a plugin overrides them the same way a third party would, by returning a
non-None result first (``tryfirst=True``).

Every hook is called in the process that holds the ``LLM``.  Hooks marked *firstresult* stop at the
first non-None result; returning None declines ("not mine").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmdock._config.model import ModelConfig, QuantConfig, SchedulerConfig
    from lmdock._config.sampling import SamplingParams
    from lmdock._config.speculative import SpeculativeConfig
    from lmdock._engine.sampler import LogitsProcessor, Sampler
    from lmdock._engine.scheduler import Scheduler
    from lmdock._plugin.contract import BackendSpec, RequestEngine, StepEngine

from lmdock._plugin.markers import hookspec  # noqa: E402

# -------------------------------------------------------------------------------------------------
# registration
# -------------------------------------------------------------------------------------------------


@hookspec
def lmdock_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare the backends this plugin provides.

    Called once per process, when the plugin manager is first used (``lmdock backends``, creating an
    ``LLM``), for each plugin in turn.  Call ``register(BackendSpec(...))`` once per backend.  Must be
    cheap: import no engine, no torch, no numpy; probe availability with
    ``importlib.util.find_spec``.  An exception here marks the plugin broken; the others carry on.

    :param register: takes a :class:`lmdock.backend.BackendSpec`; raises ``PluginError`` for a spec whose
        ``plugin_api`` major differs from the core's.
    :return: nothing.
    """


# -------------------------------------------------------------------------------------------------
# tool-call and reasoning parsers
# -------------------------------------------------------------------------------------------------


@hookspec
def lmdock_register_parsers(register: Callable[[type], None]) -> None:
    """Add tool-call parsers (a model family's call format) and reasoning parsers.

    Called once per process, the first time a parser is looked up by name (a model whose config sets
    ``tool_parser`` or ``reasoning_parser``, a chat request with ``tools``), for each plugin in turn.
    Call ``register(cls)`` with a subclass of :class:`lmdock.tools.ToolParser` or
    :class:`lmdock.tools.ReasoningParser` whose ``name`` is what a config names it by; one of the
    same name as a built-in parser replaces it.  See ``docs/tools.md``.

    :param register: takes the parser class; raises TypeError for anything else.
    :return: nothing.
    """


# -------------------------------------------------------------------------------------------------
# quantization
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def lmdock_translate_quantization(backend: str, quant: QuantConfig, model_config: ModelConfig) -> Any:
    """Translate a portable :class:`lmdock.QuantConfig` into what ``backend`` does.

    Called once per model load, before ``lmdock_load_engine``, only when ``quant.algo != "none"``.
    Stops at first non-None result.  Implementations check ``backend`` and return None for backends
    that are not theirs.

    :param backend: the selected backend's name.
    :param quant: the validated portable quantization request.
    :param model_config: the resolved model entry.
    :return: an engine-specific object passed to ``lmdock_load_engine`` as ``quantization``.
        Raise :class:`lmdock.UnsupportedError` naming the algorithm, the reason and the alternatives to
        refuse.  If every plugin returns None the core refuses with "backend X cannot quantize".
    """


# -------------------------------------------------------------------------------------------------
# build config
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def lmdock_translate_build_config(backend: str, model_config: ModelConfig) -> dict[str, Any] | None:
    """Translate the portable limits into the engine's own build / engine arguments.

    Called once per model load, before ``lmdock_load_engine``.  Stops at first non-None result.
    Reads ``model_config.build`` (max batch size, max tokens per step, max sequence length, beam
    width, dtype, device, compile, parallelism), ``model_config.kv_cache`` and
    ``model_config.scheduler``.

    :return: a dict of engine arguments passed to ``lmdock_load_engine`` as ``build``, or None to
        decline.  Raise :class:`lmdock.UnsupportedError` for a limit the engine cannot honour.
    """


# -------------------------------------------------------------------------------------------------
# model loading
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def lmdock_load_engine(
    backend: str,
    model_config: ModelConfig,
    options: Any,
    quantization: Any,
    build: dict[str, Any],
) -> StepEngine | RequestEngine | None:
    """Build an engine for a resolved model.

    Called once per ``LLM(...)`` for the selected backend (and for each fallback in turn while
    earlier ones decline).  Stops at first non-None result.  This is where heavy imports and weight
    loading happen.

    :param backend: the selected backend's name; return None if it is not yours.
    :param model_config: the resolved model entry (path or hub id, portable sections).
    :param options: the backend's own options, validated into its ``BackendSpec.options`` type.
    :param quantization: what ``lmdock_translate_quantization`` returned, or None.
    :param build: what ``lmdock_translate_build_config`` returned, or ``{}``.
    :return: a :class:`lmdock.backend.StepEngine` (if the spec's ``kind`` is ``"step"``) or a
        :class:`lmdock.backend.RequestEngine` (``"request"``), best a subclass of ``StepEngineBase`` or
        ``RequestEngineBase``, whose class declares its kind (a ``PoolingEngineBase`` for an embedding model
        or a cross-encoder, from either kind of backend); None to decline the model (the next fallback is
        tried).  Raise :class:`lmdock.BackendError` for a model it recognises but cannot load.
    """


# -------------------------------------------------------------------------------------------------
# scheduling
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def lmdock_make_scheduler(
    config: SchedulerConfig, max_seq_len: int, kv_capacity_tokens: int | None
) -> Scheduler | None:
    """Create the scheduler that orders and batches requests for a step engine.

    Called once per step-engine ``LLM``.  Stops at first non-None result.  The built-in plugin
    answers ``config.policy == "fcfs"``; a plugin answers its own policy names.

    :param config: the validated scheduler section (``policy``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``max_waiting``).
    :param max_seq_len: the engine's context length.
    :param kv_capacity_tokens: the engine's KV capacity, or None when only ``max_num_seqs`` bounds it.
    :return: an object with the :class:`lmdock.backend.Scheduler` interface (best a subclass of
        :class:`lmdock.backend.SchedulerBase`), or None to decline.
    """


# -------------------------------------------------------------------------------------------------
# sampling
# -------------------------------------------------------------------------------------------------


@hookspec
def lmdock_logits_processors(params: SamplingParams) -> list[LogitsProcessor] | None:
    """Contribute logits processors (grammars, bans, biases) for one request.

    Called once per request with the request's merged sampling parameters.  All results are used:
    the reference sampler applies penalties, then these processors (in plugin registration order,
    each plugin's list in its order), then min_new_tokens masking, temperature, min_p, top_k, top_p.

    :return: callables ``(token_ids: list[int], logits: numpy.ndarray) -> numpy.ndarray`` that take
        the sequence so far (prompt and output) and one row of float32 logits and return it changed
        (in place is fine); or None.
    """


@hookspec(firstresult=True)
def lmdock_make_sampler(backend: str, model_config: ModelConfig) -> Sampler | None:
    """Create the sampler that turns a step's logits into tokens.

    Called once per step-engine ``LLM``.  Stops at first non-None result.  The built-in reference
    sampler (NumPy) answers for every backend and defines the semantics; a backend may answer first
    with a native one (torch on GPU) that keeps them.

    :return: an object with the :class:`lmdock.backend.Sampler` interface, or None to decline.
    """


@hookspec(firstresult=True)
def lmdock_make_constraints(backend: str, model_config: ModelConfig, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """Create the structured-output factory of one step-engine ``LLM`` (a grammar engine).

    Called once per step-engine ``LLM``, with the engine's ``tokenizer``, ``vocab_size`` (the
    width of its logits rows) and ``eos_token_ids`` (allowed where the grammar accepts).
    Stops at first non-None result.  The built-in implementation on llguidance
    (``lmdock._engine.structured``, see ``docs/structured-output.md``) answers last, for every
    backend; it reads the tokenizer on the first structured request.  A plugin may answer first
    with another grammar engine.

    :return: a callable ``make(params, n)`` returning ``n`` constraints (one per completion, the
        :class:`lmdock._engine.constraints.Constraint` interface: ``allowed(out)``, ``accept(token)``,
        ``is_complete()``) for a request with ``structured_output``, or None for one without; it
        raises :class:`lmdock.RequestError` naming the problem when a grammar or schema cannot be
        compiled (that request fails alone).  Grammars reach it only after ``LLM``'s grammar check
        passed them (compiled by llguidance in a worker process: ``docs/structured-output.md``).  The callable may carry ``fill_masks(constraints, out)``,
        which fills a whole batch's boolean masks at once.  Return None to decline.
    """


@hookspec(firstresult=True)
def lmdock_speculative_proposer(config: SpeculativeConfig, engine: Any, model_config: ModelConfig) -> Any:
    """Create the proposer of speculative decoding for one step-engine ``LLM`` (issue 42).

    Called once at load when ``[models.NAME.speculative]`` names a ``method``, with the target's step
    ``engine``.  Stops at first non-None result.  The core answers last for ``ngram`` and ``draft``
    (``lmdock._engine.proposers``); a plugin may answer for its own methods (EAGLE, MTP heads).  A
    method no plugin answers for is refused at load.

    :return: an object with ``propose(seqs, limits) -> list[list[int]]``, ``accepted(seq, kept)`` and
        ``close()`` (see ``lmdock._engine.proposers.Proposer``), or None to decline.
    """
