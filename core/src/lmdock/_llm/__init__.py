"""The ``LLM`` facade and what its calls are made of (requests, chat, streams, outputs, embeddings,
beam search, genlm, LoRA, the tokenizer contract, offline batches); the code map is docs/python-api.md's.

Nothing is imported here: ``lmdock`` loads ``LLM`` lazily from :mod:`lmdock._llm.facade`.
"""
