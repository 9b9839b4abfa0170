"""A Qwen2.5-style model built here, offline: a byte-level BPE tokenizer trained with the ``tokenizers``
library on some of Python's own standard-library sources, whose ``<tool_call>``, ``</tool_call>``,
``<think>`` and ``</think>`` are *added tokens that are not special* (as Qwen2.5's and Qwen3's
tokenizer.json have them) beside the special ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>``;
Qwen's ChatML template with Hermes-style tools; and a tiny random-weight Llama of that vocabulary
(fixed seed).  Built once per folder: the folder is the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

#: Qwen2.5's template, shortened: ChatML turns, tools listed in the system turn, calls as <tool_call> JSON
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t.function.name }}{% endfor %}\n</tools>\n"
    "For each call, return <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # added, not special (Qwen2.5's)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py"]
    return [(stdlib / n).read_text(encoding="utf-8") for n in names if (stdlib / n).is_file()]


def cached() -> Path:
    """The model's folder under ``$LMDOCK_TEST_CACHE`` (default ``~/.cache/lmdock-tests``), built on first use."""
    root = Path(os.environ.get("LMDOCK_TEST_CACHE") or Path.home() / ".cache" / "lmdock-tests")
    return build(root / "qwen-like-1")


def build(folder: Path) -> Path:
    """The model's folder (built on first use, in a folder of its own then renamed: runs side by side
    never see half a model)."""
    if (folder / "config.json").is_file():
        return folder
    part = folder.with_name(f"{folder.name}.part-{os.getpid()}")
    _build(part)
    try:
        os.replace(part, folder)
    except OSError:  # another run got there first
        shutil.rmtree(part, ignore_errors=True)
    return folder


def _build(folder: Path) -> None:
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIAL)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                         bos_token_id=None, pad_token_id=fast.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)


if __name__ == "__main__":
    import sys

    print(json.dumps(str(build(Path(sys.argv[1])))))
