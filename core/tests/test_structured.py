"""lmdock._engine.structured: llguidance constraints over a real tokenizer (stories260K's tokenizer.json,
read as text: the core's test environment has no ``tokenizers`` package, and llguidance parses the JSON
itself).  Decoding here uses the vocabulary file directly, independent of llguidance."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmdock import RequestError, SamplingParams

FOLDER = Path(os.environ.get("LMDOCK_MODELS", "")) / "stories260K"
VOCAB = 512
EOS = 2


class _Backend:
    """Stands in for ``tokenizers.Tokenizer``: llguidance needs only its JSON (``to_str``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def to_str(self) -> str:
        return self.text

    def no_padding(self) -> None:
        pass

    def no_truncation(self) -> None:
        pass


class _Tokenizer:
    eos_token_id = EOS

    def __init__(self) -> None:
        text = (FOLDER / "tokenizer.json").read_text()
        self.backend_tokenizer = _Backend(text)
        self.pieces = {i: p for p, i in json.loads(text)["model"]["vocab"].items()}

    def decode(self, ids: list[int]) -> str:
        out = b""
        for i in ids:
            p = self.pieces[i]
            m = re.fullmatch(r"<0x([0-9A-F]{2})>", p)
            out += bytes([int(m.group(1), 16)]) if m else p.replace("\u2581", " ").encode()
        return out.decode()


@pytest.fixture(scope="module")
def factory() -> Any:
    if not (FOLDER / "tokenizer.json").is_file():
        pytest.fail(f"stories260K not found under LMDOCK_MODELS ({FOLDER}); set LMDOCK_MODELS to the models folder")
    from lmdock._engine.structured import ConstraintFactory

    return ConstraintFactory(_Tokenizer(), VOCAB, (EOS,))


def _params(**so: Any) -> SamplingParams:
    return SamplingParams(structured_output=so)


def _walk(factory: Any, constraint: Any, pick: Any, limit: int = 200) -> list[int]:
    """Drive one constraint to completion, choosing each token among the allowed ones with ``pick``."""
    ids: list[int] = []
    for _ in range(limit):
        if constraint.is_complete():
            break
        row = np.zeros(VOCAB, dtype=bool)
        constraint.allowed(row)
        batched = np.zeros((1, VOCAB), dtype=bool)
        factory.fill_masks([constraint], batched)
        assert (batched[0] == row).all()  # the batched filler gives the same mask
        assert row.any()
        token = pick(np.flatnonzero(row))
        constraint.accept(int(token))
        ids.append(int(token))
    return ids


def test_no_structured_output_no_constraints(factory: Any) -> None:
    assert factory(SamplingParams(), 2) is None


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_walks_give_valid_documents(factory: Any, seed: int) -> None:
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["mood", "n"], "additionalProperties": False}
    rng = np.random.default_rng(seed)
    (c,) = factory(_params(json=schema), 1)
    ids = _walk(factory, c, lambda allowed: rng.choice(allowed))
    assert c.is_complete()
    assert EOS not in ids[:-1]  # EOS only where the document is complete
    doc = json.loads(_Tokenizer().decode(ids[:-1] if ids[-1] == EOS else ids))
    assert doc["mood"] in ("happy", "sad") and 0 <= doc["n"] <= 9 and set(doc) == {"mood", "n"}


def test_eos_allowed_only_where_the_grammar_accepts(factory: Any) -> None:
    (c,) = factory(_params(choice=("yes", "yesterday")), 1)
    tok = _Tokenizer()
    row = np.zeros(VOCAB, dtype=bool)
    c.allowed(row)
    assert not row[EOS]
    text = ""
    while text != "yes":  # take tokens that spell "yes"
        row[:] = False
        c.allowed(row)
        t = next(int(t) for t in np.flatnonzero(row) if t != EOS and "yes".startswith(text + tok.decode([int(t)])) and tok.decode([int(t)]))
        c.accept(t)
        text += tok.decode([t])
    row[:] = False
    c.allowed(row)
    assert row[EOS] and row.sum() > 1  # "yes" may end here, or go on to "yesterday"


def test_completions_have_their_own_matchers(factory: Any) -> None:
    a, b = factory(_params(regex=r"(ab|cd)x"), 2)
    assert a.matcher is not b.matcher
    tok = _Tokenizer()
    row = np.zeros(VOCAB, dtype=bool)
    a.allowed(row)
    first = next(int(t) for t in np.flatnonzero(row) if tok.decode([int(t)]) == "a")
    a.accept(first)
    ra, rb = np.zeros((1, VOCAB), bool), np.zeros((1, VOCAB), bool)
    factory.fill_masks([a], ra)
    factory.fill_masks([b], rb)
    assert not (ra == rb).all()
    assert rb[0, first]


def test_compiled_grammars_are_cached(factory: Any) -> None:
    from lmdock._engine.structured import grammar_for

    so = _params(regex=r"[0-9]{4}").structured_output
    form, grammar = grammar_for(so)
    assert form == "regex"
    assert factory.compiled(grammar) is factory.compiled(grammar)


@pytest.mark.parametrize("so, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}, "unclosed group"),
    ({"regex": "[a-z"}, "structured_output.regex"),
    ({"grammar": "start: nothing_here"}, "structured_output.grammar"),
    ({"json": "not json"}, "JSON schema as JSON text"),
    ({"json": "[1, 2]"}, "a JSON schema is an object"),
])
def test_bad_grammars_raise_request_error_naming_the_problem(factory: Any, so: dict, words: str) -> None:
    with pytest.raises(RequestError, match=re.escape(words)):
        factory(_params(**so), 1)


def test_a_token_outside_the_mask_is_a_request_error(factory: Any) -> None:
    (c,) = factory(_params(choice=("yes",)), 1)
    with pytest.raises(RequestError, match="does not fit the grammar"):
        c.accept(EOS)


def test_a_tokenizer_without_a_tokenizers_backend_is_named() -> None:
    from lmdock._engine.structured import ConstraintFactory

    class Plain:
        eos_token_id = 2

    with pytest.raises(RequestError, match="backend_tokenizer"):
        ConstraintFactory(Plain(), VOCAB)(_params(regex="a"), 1)


def test_the_builtin_hook_answers_with_the_llguidance_factory() -> None:
    from lmdock._engine.structured import ConstraintFactory
    from lmdock._plugin.manager import get_registry

    reg = get_registry()
    made = reg.pm.hook.lmdock_make_constraints(backend="any", model_config=None, tokenizer=_Tokenizer(), vocab_size=VOCAB, eos_token_ids=(EOS,))
    assert isinstance(made, ConstraintFactory) and made.eos_token_ids == (EOS,)


GBNF = [  # (llama.cpp GBNF grammar, a Python regex for the same language: the independent check)
    ('root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog" | "bird"\ncolor ::= "red" | "blue"',
     r"The (cat|dog|bird) is (red|blue)\."),
    ('root ::= word (" " word){1,2} "."\nword ::= [a-z]{2,5}', r"[a-z]{2,5}( [a-z]{2,5}){1,2}\."),
    ('root ::= "id-" [0-9]+ ("-" [A-Z])?', r"id-[0-9]+(-[A-Z])?"),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gbnf, regex", GBNF, ids=["alternatives", "repetition", "optional"])
def test_gbnf_grammars_constrain_walks_to_their_language(factory: Any, gbnf: str, regex: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    (c,) = factory(_params(grammar=gbnf), 1)
    # prefer EOS where allowed after a few tokens, so unbounded repetitions end
    ids = _walk(factory, c, lambda allowed: EOS if EOS in allowed and rng.random() < 0.3 else rng.choice(allowed), limit=40)
    text = _Tokenizer().decode([i for i in ids if i != EOS])
    if c.is_complete() or (ids and ids[-1] == EOS):
        assert re.fullmatch(regex, text), (gbnf, text)
    else:  # cut by the walk's limit: a prefix of the language
        assert len(ids) == 40


def test_a_gbnf_grammar_that_cannot_be_converted_names_it(factory: Any) -> None:
    with pytest.raises(RequestError, match=r"structured_output\.grammar: this GBNF grammar cannot be converted"):
        factory(_params(grammar='root ::= "unclosed'), 1)
