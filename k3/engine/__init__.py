"""The inference engine: chat format, sampling, generation with the hybrid cache, the worker and the server.

It sees token ids only; text becomes tokens in `k3.tokenizer`. Modules (imported one by one, so
`k3 --help` stays fast; nothing is re-exported here): `chat` (the K3 chat format, `encode_chat`,
`ReplyStream`), `sampling` (`SamplingParams`, `sample_token`), `generate` (`Engine`: chunked prefill,
continuous batching, `cache_bytes_formula`), `worker` (the engine thread), `server` (`create_app`),
`commands` (CLI).
"""
