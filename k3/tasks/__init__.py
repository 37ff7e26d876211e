"""Verifiable tasks: problems with reference answers and graders (`task`: the interface; `exact_match`:
arithmetic, sort, recall; `code_task`: programs graded in a sandbox; `tool_task`: a calculator call in
K3's chat format; `effort`: scratchpads; `mixture`: several tasks; `registry`: `make_task` by name;
`codec`: text <-> ids). See docs/rl.md."""
