"""The planted model on its own, by transformers' own ``generate`` (greedy): each marker starts its
chain, so a CLI test that fails points at the server or the CLI, not at the model."""

from __future__ import annotations

import planted
import pytest


@pytest.mark.parametrize(("marker", "expected"), [("claude", planted.CLAUDE_CALL), ("codex", planted.CODEX_CALL),
                                                  ("answer", "".join(planted.SENTENCE))])
def test_each_marker_starts_its_chain(marker: str, expected: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = planted.cached()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    ids = tok("<|bos|>user\nsome question\n" + planted.MARKERS[marker], add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out[-1] == tok.eos_token_id and len(out) < 20
    assert tok.decode(out[:-1]) == expected


def test_the_template_picks_the_chain_from_the_conversation() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(planted.cached())
    read = [{"type": "function", "function": {"name": "Read", "parameters": {}}}]
    exec_ = [{"type": "function", "function": {"name": "exec_command", "parameters": {}}}]
    ask = [{"role": "user", "content": "hi"}]
    after = [*ask, {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
             "function": {"name": "Read", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}]

    def end(messages: list, tools: list) -> str:
        return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert end(ask, read).endswith(planted.MARKERS["claude"])
    assert end(ask, exec_).endswith(planted.MARKERS["codex"])
    assert end(after, read).endswith(planted.MARKERS["answer"])
    assert end(ask, []).endswith(planted.MARKERS["answer"])
