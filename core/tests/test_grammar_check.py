"""lmdock._grammar.check and lmdock._grammar.processes: a request's grammar is compiled in a worker process
first (issue 39), with stories260K's real tokenizer (read as JSON by llguidance in the worker).

The crashing grammars overflow llguidance's stack (docs/upstream/llguidance-deep-grammar-crash.md):
here a worker dies of them, the check says so, and the next check gets a fresh worker."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from lmdock import GrammarError, RequestError, StructuredOutput
from test_structured import FOLDER, _Tokenizer

N = 5000


def chained_lark(n: int = N, tag: str = "") -> str:
    return f"start: r0{tag}\n" + "".join(f"r{i}{tag}: r{i + 1}{tag}\n" for i in range(n)) + f'r{n}{tag}: "x"\n'


def chained_defs(n: int = N) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture
def pool() -> Iterator[Any]:
    if not (FOLDER / "tokenizer.json").is_file():
        pytest.fail(f"stories260K not found under LMDOCK_MODELS ({FOLDER}); set LMDOCK_MODELS to the models folder")
    from lmdock._grammar.processes import GrammarPool

    p = GrammarPool(size=1)
    yield p
    p.close()


def checker(pool: Any) -> Any:
    from lmdock._grammar.check import GrammarCheck

    return GrammarCheck(_Tokenizer(), pool)


@pytest.mark.parametrize("so, tag", [(StructuredOutput(grammar=chained_lark()), "lark"), (StructuredOutput(json=chained_defs()), "json")],
                         ids=["lark", "json-defs"])
def test_a_grammar_that_crashes_the_compiler_is_refused_and_its_worker_replaced(pool: Any, so: StructuredOutput, tag: str) -> None:
    check = checker(pool)
    with pytest.raises(GrammarError, match=r"crashed the grammar compiler \(signal SIGSEGV\)") as info:
        check.check(so)
    assert isinstance(info.value, RequestError)  # the server's 400
    assert pool.started == 1 and not pool.workers()  # the dead one's place waits for a fresh one
    check.check(StructuredOutput(regex=rf"{tag} [a-z]{{2,4}}"))  # a grammar no other test checked
    assert pool.started == 2 and len(pool.workers()) == 1


def test_a_worker_killed_mid_check_is_replaced(pool: Any) -> None:
    check = checker(pool)
    check.check(StructuredOutput(choice=("warm", "up")))  # starts the worker
    (worker,) = pool.workers()
    slow = StructuredOutput(choice=tuple(f"option number {i}" for i in range(20000)))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            check.check(slow)
        except GrammarError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while pool.workers():  # until the check has taken the worker
        time.sleep(0.01)
    os.kill(worker.proc.pid, signal.SIGKILL)
    thread.join()
    (error,) = errors
    assert "crashed the grammar compiler (signal SIGKILL)" in str(error)
    check.check(StructuredOutput(choice=("after", "kill")))
    assert pool.started == 2


def test_a_grammar_is_checked_once_per_tokenizer(pool: Any) -> None:
    check = checker(pool)
    so = StructuredOutput(regex=r"(cat|dog) [0-9]{2} times")
    check.check(so)
    assert pool.checks == 1
    check.check(StructuredOutput(regex=r"(cat|dog) [0-9]{2} times"))  # equal, not the same object
    checker(pool).check(so)  # another LLM with the same tokenizer
    assert pool.checks == 1
    check.check(StructuredOutput(regex=r"(cat|dog) [0-9]{3} times"))
    assert pool.checks == 2


def test_a_refusal_is_cached_too(pool: Any) -> None:
    check = checker(pool)
    so = StructuredOutput(grammar=chained_lark(tag="c"))
    for _ in range(2):
        with pytest.raises(GrammarError, match="crashed"):
            check.check(so)
    assert pool.checks == 1 and pool.started == 1  # no second worker died of it


def test_a_regex_that_can_produce_no_token_is_refused_by_the_check(pool: Any) -> None:
    with pytest.raises(GrammarError, match=r"structured_output\.regex: the grammar cannot produce a first token"):
        checker(pool).check(StructuredOutput(regex=r"[^\s\S]"))


def test_a_check_past_its_deadline_is_refused_and_the_worker_replaced() -> None:
    from lmdock._grammar.processes import GrammarPool

    pool = GrammarPool(size=1, deadline_s=0.0)  # the reply cannot be there before the deadline
    try:
        with pytest.raises(GrammarError, match="did not compile within 0 s"):
            checker(pool).check(StructuredOutput(regex=r"deadline [a-z]+"))
        assert not pool.workers()
    finally:
        pool.close()


def test_bad_grammars_are_refused_naming_the_field(pool: Any) -> None:
    check = checker(pool)
    with pytest.raises(GrammarError, match=r"structured_output\.regex: llguidance cannot compile it"):
        check.check(StructuredOutput(regex="[a-z"))
    with pytest.raises(GrammarError, match=r"structured_output\.grammar: this GBNF grammar cannot be converted"):
        check.check(StructuredOutput(grammar='root ::= "a'))


def test_a_tokenizer_without_a_tokenizers_json_is_checked_against_a_byte_level_stand_in(pool: Any) -> None:
    from lmdock._grammar.check import GrammarCheck, tokenizer_spec

    class GGUFLike:  # lmdock-llamacpp's tokenizer: no Hugging Face backend to send to a worker
        eos_token_id = 2

    assert tokenizer_spec(GGUFLike()) == ("bytes",)
    check = GrammarCheck(GGUFLike(), pool)
    check.check(StructuredOutput(grammar='root ::= "stand" [a-z]+'))
    with pytest.raises(GrammarError, match="crashed the grammar compiler"):
        check.check(StructuredOutput(grammar=chained_lark(tag="b")))
    with pytest.raises(GrammarError, match="cannot produce a first token"):
        check.check(StructuredOutput(regex=r"[^\s\S]"))
