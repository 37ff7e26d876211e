"""The inference engine: sampling, generation with the hybrid cache, the worker and the server.

It sees token ids only; text becomes tokens in `k3.tokenizer`, chats in `k3.chat`. Modules (imported one
by one, so `k3 --help` stays fast; nothing is re-exported here): `chat` (OpenAI's chat requests -> K3's
chat format and replies: `chat_prompt`, `reply_message`), `sampling` (`SamplingParams`, `sample_token`,
`sampling_logprobs`), `generate` (`Engine`: chunked prefill, continuous batching, token-in/token-out
`complete` -> `Completion`, `load_weights`, `cache_bytes_formula`), `worker` (the engine thread),
`protocol` (the API's request bodies and errors), `outputs` (events to OpenAI text and logprobs), `server`
(`create_app`), `commands` (CLI).
"""
