"""The whole model on a small machine: a layer-major streaming runner (`k3 stream`, docs/stream.md).

    from k3.stream import stream_logits
    result = stream_logits("ckpt/", [[1, 2, 3], [4, 5]])     # or an http(s) URL of a checkpoint
    result.outputs["logits"]                       # [P, V] float32, the last position of each prompt

Modules: `plan` (stages and their byte spans), `fetch` (reads into owned buffers, a thread ahead), `layer`
(one layer's modules at a time), `scratch` (state on disk: resume, spill), `runner` (the schedule),
`api` (open a source and run), `compare` (against another engine's logits), `bound` (the memory formula),
`memory` (RSS, allocator), `cgroup` (memory cgroups for tests and benchmarks), `commands` (`k3 stream`).
"""

from k3.lazy import lazy_exports

_EXPORTS = {
    "StreamError": "k3.stream.runner",
    "StreamOptions": "k3.stream.runner",
    "StreamResult": "k3.stream.runner",
    "StreamPlan": "k3.stream.plan",
    "compare_logits": "k3.stream.compare",
    "stream_logits": "k3.stream.api",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
