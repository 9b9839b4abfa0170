"""Build ``bamba-tiny.gguf`` (a tiny random-weight Bamba: one Mamba-2 layer, one attention layer) and
``bamba-tiny.json`` (prompts and transformers' own greedy tokens for them), which
test_recurrent.py reads.  Needs torch, transformers, tokenizers, lmdock-conformance (its zoo's random_model)
and llama.cpp's converter, from the
llama-cpp-python sdist lmdock-llamacpp builds against::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36   # or take the .tar.gz pip unpacks
    tar xzf llama_cpp_python-0.3.36.tar.gz
    L=llama_cpp_python-0.3.36/vendor/llama.cpp
    PYTHONPATH=$L/gguf-py python make_hybrid.py --converter $L/convert_hf_to_gguf.py --tokenizer ../shared/models/stories260K

Seeded; 2-D weights re-drawn with std 0.15 (embeddings 1.0) so greedy choices are not near-ties; head_dim 32;
stories260K's SentencePiece tokenizer (the converter takes it for Mamba-2 families).  ``partial_rotary_factor``
is 1.0: transformers' Bamba ropes half of each head by default, llama.cpp's granite-hybrid graph the whole head,
so with the default the GGUF's first token already differs from transformers' (a converter/llama.cpp matter).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SEED = 38
NEW = 24
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. One day"
CONFIG = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0, "tie_word_embeddings": False, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32,
          "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_chunk_size": 16,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 1.0}}


def build(folder: Path, tokenizer: Path) -> object:
    from lmdock_conformance.zoo import random_model  # the zoo's widened random weights

    model = random_model("bamba", CONFIG, SEED)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    return model


def greedy(model: object, prompt: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--converter", required=True, type=Path)
    parser.add_argument("--tokenizer", required=True, type=Path)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    here = Path(__file__).parent
    story = [1, *Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).encode(STORY, add_special_tokens=False).ids]
    # one long prompt, a mixed-length batch, and a shared 24-token prefix (bare, and with more after it)
    prompts = [story[:38], story[:5], story[:13], story[:22], story[:31], story[:24], story[:24] + story[30:34]]
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp), args.tokenizer)
        subprocess.run([sys.executable, str(args.converter), tmp, "--outfile", str(here / "bamba-tiny.gguf"), "--outtype", "f32"],
                       check=True)
        reference = [greedy(model, p) for p in prompts]
    (here / "bamba-tiny.json").write_text(json.dumps({"prompts": prompts, "reference": reference}) + "\n")


if __name__ == "__main__":
    main()
