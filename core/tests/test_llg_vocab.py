"""lmdock._engine.llg_vocab: non-special added tokens moved into a BPE vocabulary, spelled as the
vocabulary spells text (byte-level: GPT-2's byte map, which tests_serve/test_agents_qwen.py checks
against the ``tokenizers`` library; SentencePiece-style: ``▁`` for a space)."""

from __future__ import annotations

import json

from lmdock._engine.llg_vocab import added_tokens_as_text


def _tok(pre: dict | None, model_type: str = "BPE") -> str:
    vocab: object = {"a": 0, "b": 1} if model_type == "BPE" else [["a", 0.0], ["b", 0.0]]
    return json.dumps({"model": {"type": model_type, "vocab": vocab}, "pre_tokenizer": pre, "decoder": None, "added_tokens": [
        {"id": 2, "content": "<|im_end|>", "special": True}, {"id": 3, "content": "<tool_call>", "special": False},
        {"id": 4, "content": " é", "special": False}]})


def test_byte_level_spelling() -> None:
    out = json.loads(added_tokens_as_text(_tok({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}]})))
    assert out["model"]["vocab"] == {"a": 0, "b": 1, "<tool_call>": 3, "\u0120\u00c3\u00a9": 4}  # GPT-2's "Ġé" as bytes
    assert [a["content"] for a in out["added_tokens"]] == ["<|im_end|>"]


def test_sentencepiece_spelling() -> None:
    out = json.loads(added_tokens_as_text(_tok({"type": "Metaspace"})))
    assert out["model"]["vocab"]["\u2581é"] == 4 and out["model"]["vocab"]["<tool_call>"] == 3


def test_other_models_and_no_plain_tokens_are_unchanged() -> None:
    unigram = _tok(None, "Unigram")
    assert added_tokens_as_text(unigram) == unigram
    only_special = json.dumps({"model": {"type": "BPE", "vocab": {}}, "added_tokens": [{"id": 0, "content": "<s>", "special": True}]})
    assert added_tokens_as_text(only_special) == only_special


def test_a_token_spelled_as_a_vocabulary_entry_stays_an_added_token() -> None:
    """An added "b" beside the vocabulary's own "b" cannot move in under its id (the vocabulary would
    lose that id and llguidance would number the tokens after it wrongly): it stays added."""
    tok = json.loads(_tok({"type": "Metaspace"}))
    tok["added_tokens"].append({"id": 5, "content": "b", "special": False})
    out = json.loads(added_tokens_as_text(json.dumps(tok)))
    assert out["model"]["vocab"]["b"] == 1 and out["model"]["vocab"]["<tool_call>"] == 3
    assert [a["id"] for a in out["added_tokens"]] == [2, 5]
