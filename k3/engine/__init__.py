"""The inference engine: sampling, generation with the hybrid cache, the worker and the server.

It sees token ids only; text becomes tokens in `k3.tokenizer`, chats in `k3.chat`. Modules (imported one
by one, so `k3 --help` stays fast; nothing is re-exported here): `chat` (OpenAI's chat requests -> K3's
chat format and replies: `chat_prompt`, `reply_message`), `chat_inputs` (a chat request's images and
prompt ids, bad ones as 400s), `images`, `sampling` (`SamplingParams`, `sample_token`,
`sampling_logprobs`), `generate` (`Engine`: chunked prefill, continuous batching, token-in/token-out
`complete`, `load_weights`), `sequence` (`Sequence`, `Event`, `Completion`, `EngineError`),
`sequence_cache` (where a sequence's cache starts and is stored: prefix cache, kept states;
`cache_bytes_formula`), `prefix_cache`, `state_store`, `worker` (the engine thread), `protocol` (the API's
request bodies and errors), `outputs` (events to OpenAI text and logprobs), `responses` (SSE, merged
choices, disconnects), `server` (`create_app`), `tokenize_api` (`/tokenize`, `/detokenize`,
`/tokenizer_info`), `commands` (CLI).
"""
