"""The inference engine: tokenizer, chat format, sampling, generation with the hybrid cache, the server.

Modules (imported one by one, so `k3 --help` stays fast; nothing is re-exported here):
`tokenizer` (Tokenizer, the Kimi split pattern, special ids), `build_tokenizer` (deterministic small BPE,
`write_tokenizer(out_dir, vocab_size)`), `chat` (the K3 chat format, `encode_chat`, `ReplyStream`),
`sampling` (`SamplingParams`, `sample_token`), `generate` (`Engine`: chunked prefill, continuous batching,
`cache_bytes_formula`), `worker` (the engine thread), `server` (`create_app`), `commands` (CLI).
"""
