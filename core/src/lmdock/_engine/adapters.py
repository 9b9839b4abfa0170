"""The one place where the core looks at which members an engine or a scheduler has.

An engine that subclasses ``lmdock.backend``'s ``StepEngineBase``, ``RequestEngineBase`` or
``PoolingEngineBase`` declares its kind on its class and has every optional member, with its default.
One written without them (a third-party plugin's, an older one) keeps loading: here its kind is told from
its members, and it is seen through its kind's base, which gives it the defaults for what it lacks.  The
loader does this once, as it hands the engine to the core; everywhere else the core reads members
directly (``core/tests/test_engine_probes.py`` fails on a ``hasattr``/``getattr`` of an engine or a
scheduler outside this module).  Schedulers from ``lmdock_make_scheduler`` get the same treatment.

Each adapter looks a call up on the wrapped object when it is made (not bound once here), so a method
replaced after loading (a test's spy) is the one the core calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lmdock._engine.request_engine import EngineKind, PoolingEngineBase, RequestEngineBase
from lmdock._engine.scheduler import SchedulerBase
from lmdock._engine.step_engine import NO_LORA_FIX, StepEngineBase, no_images
from lmdock._plugin.errors import RequestError

if TYPE_CHECKING:
    from lmdock._llm.lora import LoRARequest
    from lmdock._plugin.contract import EngineRequest, OutputSink, SeqChunk, StepOutput


def engine_kind(engine: Any, declared: str) -> EngineKind:
    """The kind of what a load hook returned: the one its class declares, else told from its members
    (``embed`` and ``task`` without ``step``: pooling; ``step``: step; ``submit``: request), else the
    kind its backend declares."""
    if isinstance(engine, (StepEngineBase, RequestEngineBase, PoolingEngineBase)):
        return engine.kind
    if hasattr(engine, "embed") and hasattr(engine, "task") and not hasattr(engine, "step"):
        return "pooling"  # an embedding model or a cross-encoder, from a step or a request backend alike
    if hasattr(engine, "step"):
        return "step"
    return "request" if hasattr(engine, "submit") else declared  # type: ignore[return-value]


def _passed(name: str, default: Any) -> property:
    return property(lambda self: getattr(self.wrapped, name, default), doc=f"the engine's ``{name}``, else {default!r}")


def _own(wrapped: Any, name: str) -> Callable[..., Any] | None:
    return getattr(wrapped, name, None)


# -- step engines -------------------------------------------------------------------------------------

def as_step_engine(engine: Any) -> StepEngineBase:
    """``engine`` itself when it subclasses :class:`StepEngineBase`; else the engine behind an adapter
    that gives it the base's defaults for the optional members it lacks."""
    return engine if isinstance(engine, StepEngineBase) else _AdaptedStep(engine)


class _AdaptedStep(StepEngineBase):
    """A step engine written without :class:`StepEngineBase`, seen through the base.  Every attribute
    the base does not define (``tokenizer``, ``vocab_size``, an engine's own) is the engine's."""

    kv_capacity_tokens = _passed("kv_capacity_tokens", None)  # type: ignore[assignment]
    fork_truncates = _passed("fork_truncates", True)  # type: ignore[assignment]
    truncates = property(lambda self: bool(getattr(self.wrapped, "truncates", hasattr(self.wrapped, "truncate"))),  # type: ignore[assignment]
                         doc="the engine's ``truncates``, else whether it has a ``truncate``")
    overlap_host_work = _passed("overlap_host_work", False)  # type: ignore[assignment]
    scheduler_limits = _passed("scheduler_limits", None)  # type: ignore[assignment]
    max_loras = _passed("max_loras", 0)  # type: ignore[assignment]
    adapters = _passed("adapters", None)  # type: ignore[assignment]

    def __init__(self, engine: Any) -> None:  # the base's fields are the engine's: not set here
        self.wrapped = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def step(self, chunks: Sequence[SeqChunk]) -> StepOutput:
        return self.wrapped.step(chunks)

    def release(self, seq_id: int) -> None:
        self.wrapped.release(seq_id)

    def num_sequences(self) -> int:
        return self.wrapped.num_sequences()

    def fork(self, src_seq_id: int, dst_seq_id: int, length: int) -> bool:
        return bool(self.wrapped.fork(src_seq_id, dst_seq_id, length))

    def truncate(self, seq_id: int, length: int) -> bool:
        own = _own(self.wrapped, "truncate")
        return bool(own(seq_id, length)) if own is not None else False

    def prepare_lora(self, lora: LoRARequest) -> None:
        own = _own(self.wrapped, "prepare_lora")
        if own is None:
            raise RequestError(f"lora_request {lora.name!r}: this step engine ({type(self.wrapped).__name__}) cannot run "
                               f"LoRA adapters (it has no prepare_lora); {NO_LORA_FIX}")
        own(lora)

    def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        own = _own(self.wrapped, "process_multimodal")
        if own is None:
            raise no_images(type(self.wrapped).__name__)
        return list(own(text, data, add_special_tokens))

    def thread_exit(self) -> None:
        own = _own(self.wrapped, "thread_exit")
        if own is not None:
            own()

    def close(self) -> None:
        self.wrapped.close()


# -- request engines ----------------------------------------------------------------------------------

def as_request_engine(engine: Any) -> RequestEngineBase:
    """``engine`` itself when it subclasses :class:`RequestEngineBase`; else the engine behind an
    adapter that gives it the base's defaults for the optional members it lacks."""
    return engine if isinstance(engine, RequestEngineBase) else _AdaptedRequest(engine)


class _AdaptedRequest(RequestEngineBase):
    """A request engine written without :class:`RequestEngineBase`, seen through the base; its fields
    (``tokenizer``, ``max_seq_len``, ``generation_config``) and its own attributes are the engine's."""

    submit_on_loop = _passed("submit_on_loop", False)  # type: ignore[assignment]

    def __init__(self, engine: Any) -> None:  # the base's fields are the engine's: not set here
        self.wrapped = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        self.wrapped.submit(request, sink)

    def abort(self, request_id: str) -> None:
        self.wrapped.abort(request_id)

    def prepare_lora(self, lora: LoRARequest) -> None:
        own = _own(self.wrapped, "prepare_lora")
        if own is not None:
            own(lora)

    def process_multimodal(self, text: str, data: Any, add_special_tokens: bool) -> list[int]:
        own = _own(self.wrapped, "process_multimodal")
        return list(own(text, data, add_special_tokens)) if own is not None else super().process_multimodal(text, data, add_special_tokens)

    def next_token_logprobs(self, token_ids: Sequence[int]) -> Any:
        own = _own(self.wrapped, "next_token_logprobs")
        return own(token_ids) if own is not None else super().next_token_logprobs(token_ids)

    def clear_cache(self) -> None:
        own = _own(self.wrapped, "clear_cache")
        if own is not None:
            own()

    def stats(self) -> dict[str, Any]:
        own = _own(self.wrapped, "stats")
        return dict(own()) if callable(own) else {}

    def close(self) -> None:
        own = _own(self.wrapped, "close")
        if own is not None:
            own()


# -- schedulers ---------------------------------------------------------------------------------------

def as_scheduler(scheduler: Any) -> SchedulerBase:
    """``scheduler`` itself when it subclasses :class:`SchedulerBase`; else the scheduler behind an
    adapter that gives it the base's defaults for the optional members it lacks."""
    return scheduler if isinstance(scheduler, SchedulerBase) else _AdaptedScheduler(scheduler)


def _settable(name: str, default: Any, takes: Callable[[Any], bool]) -> property:
    """The scheduler's ``name`` (else ``default``); set only where ``takes(scheduler)``: a scheduler
    without the member ignores what the core would tell it."""
    def set_(self: Any, value: Any) -> None:
        if takes(self.wrapped):
            setattr(self.wrapped, name, value)

    return property(lambda self: getattr(self.wrapped, name, default), set_)


class _AdaptedScheduler(SchedulerBase):
    """A scheduler written without :class:`SchedulerBase`, seen through the base."""

    capacity = _settable("capacity", None, lambda s: hasattr(s, "capacity"))  # type: ignore[assignment]
    # only a scheduler that declares ``reclaim = None`` asks before it evicts
    reclaim = _settable("reclaim", None, lambda s: getattr(s, "reclaim", False) is None)  # type: ignore[assignment]
    config = _passed("config", None)  # type: ignore[assignment]
    running = _passed("running", ())  # type: ignore[assignment]
    waiting = _passed("waiting", ())  # type: ignore[assignment]

    def __init__(self, scheduler: Any) -> None:
        self.wrapped = scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def add(self, seq: Any) -> None:
        self.wrapped.add(seq)

    def remove(self, seq: Any) -> None:
        self.wrapped.remove(seq)

    def schedule(self) -> Any:
        return self.wrapped.schedule()

    def has_work(self) -> bool:
        return bool(self.wrapped.has_work())

    def fork(self, parent: Any, child: Any) -> None:
        own = _own(self.wrapped, "fork")
        if own is not None:
            own(parent, child)
        else:
            self.wrapped.add(child)
