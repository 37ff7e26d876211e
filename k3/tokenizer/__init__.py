"""Tokens as text: the K3 tokenizer and the builder of small ones for synthetic checkpoints.

Modules (imported one by one, nothing is re-exported here): `kimi` (`Tokenizer`: tiktoken BPE ranks plus
the Kimi split pattern and special ids, in the Kimi release format), `build` (a deterministic small BPE
learned from the built-in corpus `data/corpus.txt`: `write_tokenizer(out_dir, vocab_size)`,
`builtin_tokenizer(vocab_size)`). The engine, trainer, atlas and `k3 init` take their tokenizer from here;
the engine itself only sees token ids.
"""
