"""A tiny random-weight Llama whose greedy output is planted: the tests' stand-in for an agent model.

One layer whose attention ``o_proj`` and MLP ``down_proj`` are zero, so the residual stream at the
last position is that token's embedding and the logits are ``lm_head(norm(embed[last]))``: a bigram
table.  The chain tokens get orthogonal embeddings and ``lm_head`` maps each to its successor with a
margin of ~16 nats; the other weights (q/k/v, gate/up, the other embeddings) stay random.

The tokenizer is byte-level with no merges (every byte a token), special tokens for the markers the
chat template (:data:`TEMPLATE`) ends a prompt with, and vocabulary entries that no merge reaches for
one whole Hermes tool call per CLI (one token, so the bigram never meets a repeated token with two
successors; the server's tool grammar still has to let its bytes through) and the words of
:data:`SENTENCE`.  Built once and cached."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

#: what the model writes after a tool result (or with no tools)
SENTENCE = ["Planted", " answer:", " the", " tool", " turn", " is", " complete."]
#: the calls' arguments: Claude Code reads a file, Codex runs ``echo`` in its sandbox
CLAUDE_ARGS = {"file_path": "/etc/hostname"}
CODEX_ARGS = {"cmd": "echo planted-echo"}


def hermes(name: str, arguments: dict[str, str]) -> str:
    """A whole Hermes call, JSON compact as the server's tool grammar writes it (no free whitespace)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "\n</tool_call>"


#: the calls, one token each
CLAUDE_CALL = hermes("Read", CLAUDE_ARGS)
CODEX_CALL = hermes("exec_command", CODEX_ARGS)
MARKERS = {"claude": "<|claude_turn|>", "codex": "<|codex_turn|>", "answer": "<|answer_turn|>"}
EOS = "<|end|>"
#: the prompt ends with the marker that picks the chain: a tool result last -> the sentence; tools
#: with Claude Code's ``Read`` -> its call; tools with Codex's ``exec_command`` -> its call
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}\n{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% set names = (tools or []) | map(attribute='function') | map(attribute='name') | list %}"
    "{% if messages and messages[-1].role == 'tool' %}<|answer_turn|>"
    "{% elif 'Read' in names %}<|claude_turn|>{% elif 'exec_command' in names %}<|codex_turn|>"
    "{% else %}<|answer_turn|>{% endif %}{% endif %}"
)
HIDDEN = 64


def chains() -> list[list[str]]:
    return [[MARKERS["claude"], CLAUDE_CALL, EOS], [MARKERS["codex"], CODEX_CALL, EOS],
            [MARKERS["answer"], *SENTENCE, EOS]]


def cache_dir() -> Path:
    key = hashlib.sha256(json.dumps([chains(), TEMPLATE, HIDDEN, 2]).encode()).hexdigest()[:12]
    root = Path(os.environ.get("LMDOCK_TEST_CACHE") or Path.home() / ".cache" / "lmdock-tests")
    return root / f"planted-{key}"


def cached() -> Path:
    """The model's folder under ``$LMDOCK_TEST_CACHE`` (default ``~/.cache/lmdock-tests``), built on first use."""
    out = cache_dir()
    if not (out / "model.safetensors").exists():
        tmp = out.with_name(out.name + f".{os.getpid()}")
        build(tmp)
        tmp.rename(out)  # atomic: a concurrent builder's rename fails harmlessly on an existing dir
    return out


def build(out: Path) -> None:
    tok = tokenizer()
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    model(tok).save_pretrained(out)


def tokenizer():  # noqa: ANN201 - transformers' fast tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte = pre_tokenizers.ByteLevel  # its byte-to-character map spells vocabulary entries
    alphabet = sorted(byte.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for piece in [CLAUDE_CALL, CODEX_CALL, *SENTENCE]:  # ordinary vocabulary entries, no merges reach them
        (spelled,) = [s for s, _ in byte(add_prefix_space=False, use_regex=False).pre_tokenize_str(piece)]
        vocab[spelled] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = byte(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<|bos|>", EOS, *MARKERS.values()]])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|bos|>", eos_token=EOS, pad_token=EOS)


def token_id(tok, piece: str) -> int:  # noqa: ANN001
    """``piece``'s one token (a vocabulary entry or a special token)."""
    ids = tok.convert_tokens_to_ids(tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(piece)[0][0]
                                    if piece not in tok.all_special_tokens else piece)
    return ids


def model(tok):  # noqa: ANN001, ANN201 - transformers objects
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=131072,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id)
    m = LlamaForCausalLM(config)
    with torch.no_grad():
        m.model.layers[0].self_attn.o_proj.weight.zero_()
        m.model.layers[0].mlp.down_proj.weight.zero_()
        m.model.norm.weight.fill_(1.0)
        m.lm_head.weight.zero_()
        links = [(a, b) for chain in chains() for a, b in zip(chain, chain[1:])]
        for axis, (a, b) in enumerate(links):
            ia, ib = token_id(tok, a), token_id(tok, b)
            m.model.embed_tokens.weight[ia] = 0.0
            m.model.embed_tokens.weight[ia, axis] = 1.0  # RMSNorm makes this sqrt(HIDDEN) = 8
            m.lm_head.weight[ib, axis] = 2.0  # logit 16 for the successor, 0 for the rest
    m.generation_config.eos_token_id = tok.eos_token_id
    m.generation_config.bos_token_id = tok.bos_token_id
    return m
