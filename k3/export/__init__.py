"""Export k3 checkpoints for other engines: GGUF for llama.cpp (`k3 export gguf`).

Modules: ``gguf`` (the tensor plan, the metadata and the writer), ``vocab`` (the tokenizer as llama.cpp's
`gpt2` vocabulary), ``commands`` (the CLI).
"""
