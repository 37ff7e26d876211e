"""K3's chat format as the release writes it (XTML), and the way back from the model's output.

Modules (imported one by one, nothing is re-exported here): `xtml` (the markers, segments, attribute
escaping and the XTML value types), `normalize` (what the release does to a conversation before rendering
it: tool results re-sorted into call order, tool-call arguments parsed, schemas key-sorted), `encoder`
(`chat_segments`: a conversation -> segments; `encode_chat`: -> the token ids the model prefills),
`parser` (`ReplyParser`: the model's output ids, token by token -> reasoning, content and tool calls).
docs/chat.md describes the format with an example of every element.
"""
