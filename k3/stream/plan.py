"""What the streaming runner reads, stage by stage: the tensors of each stage and their byte spans.

Per layer i there are three kinds of stage, read in this order:

* `mixer`: the layer's norms, AttnRes projections and attention (KDA or MLA) weights;
* `ffn`: the dense MLP, or the router, latent projections, latent norm and shared experts of an MoE layer;
* `expert`: one routed expert (its w1, w3, w2, packed and scales): read only when some token chose it.

Before the layers comes `embed` (the rows of the embedding table that the pass's tokens use, `embed_rows`),
after them `head` (the output AttnRes read, the final norm, lm_head). A checkpoint with a vision tower has one
more stage, `vision` (every `vision_tower.*` and `mm_projector.*` tensor), read before `embed` by a first
pass whose prompts hold images. A stage's tensors are grouped into
spans of contiguous bytes of one shard: a reader fetches each span with one read (one HTTP request). Names
are module paths relative to what the stage builds (`self_attn.q_proj.weight` for a layer,
`w1.weight_packed` for an expert, `model.norm.weight` for the head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3.checkpoint import Checkpoint, TensorInfo
from k3.config import K3Config
from k3.model.loading import VISION_PREFIXES, ModelLoadError, match_layout, match_vision, model_name
from k3.model.on_demand import expert_of


@dataclass(frozen=True)
class Span:
    """Bytes [start, stop) of one shard file."""

    shard: str
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Stage:
    kind: str  # "vision" | "embed" | "mixer" | "ffn" | "expert" | "head" | "lm_head"
    layer: int | None
    expert: int | None
    tensors: tuple[tuple[str, TensorInfo], ...]  # (module-relative name, where it lives), in file order

    @property
    def label(self) -> str:
        if self.kind == "expert":
            return f"layer {self.layer} expert {self.expert}"
        return self.kind if self.layer is None else f"layer {self.layer} {self.kind}"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.tensors)

    @property
    def offset(self) -> tuple[str, int]:
        """Where the stage starts in the files (shard, byte): experts are read in this order."""
        first = self.tensors[0][1]
        return first.shard, first.start

    def spans(self) -> list[Span]:
        """The stage's bytes as maximal runs of contiguous bytes (tensors of a stage may be interleaved
        with others in the files: each run is one read)."""
        spans: list[Span] = []
        for _, t in sorted(self.tensors, key=lambda item: (item[1].shard, item[1].start)):
            last = spans[-1] if spans else None
            if last is not None and last.shard == t.shard and last.stop == t.start:
                spans[-1] = Span(t.shard, last.start, t.end)
            else:
                spans.append(Span(t.shard, t.start, t.end))
        return spans


HEAD_BLOCK_BYTES = 256 * 2**20  # one stage of lm_head rows


def _rows(t: TensorInfo, a: int, b: int) -> TensorInfo:
    """Rows [a, b) of a 2-D tensor: where they lie in its shard."""
    row = t.nbytes // t.shape[0]
    return replace(t, shape=(b - a, *t.shape[1:]), start=t.start + a * row, end=t.start + b * row)


MLP_ORDER = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _ffn_stages(layer: int, tensors: list[tuple[str, TensorInfo]]) -> tuple[Stage, ...]:
    if sorted(name for name, _ in tensors) == sorted(MLP_ORDER):
        found = dict(tensors)
        return tuple(Stage("ffn", layer, None, ((name, found[name]),)) for name in MLP_ORDER)
    return (Stage("ffn", layer, None, _sorted(tensors)),)


def _sorted(items: list[tuple[str, TensorInfo]]) -> tuple[tuple[str, TensorInfo], ...]:
    return tuple(sorted(items, key=lambda item: (item[1].shard, item[1].start)))


class StreamPlan:
    """The stages of a checkpoint for all its layers (names and shapes checked as `from_pretrained` does)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        cfg = ckpt.config
        if cfg is None:
            raise ModelLoadError(f"{ckpt.location}: no usable config.json ({ckpt.config_error})")
        self.config: K3Config = cfg
        self.num_layers = n = cfg.num_hidden_layers
        found = {t.name: (t.dtype, tuple(t.shape)) for t in ckpt.tensors()}
        names = match_layout(cfg, found, n, ckpt.location)  # {published: checkpoint name}
        embed: list[tuple[str, TensorInfo]] = []
        head: list[tuple[str, TensorInfo]] = []
        lm_head: TensorInfo | None = None
        mixer: list[list[tuple[str, TensorInfo]]] = [[] for _ in range(n)]
        ffn: list[list[tuple[str, TensorInfo]]] = [[] for _ in range(n)]
        experts: list[dict[int, list[tuple[str, TensorInfo]]]] = [{} for _ in range(n)]
        for published, name in names.items():
            info, path = ckpt.info(name), model_name(cfg, published)  # `model.layers.3.self_attn....`
            if (expert := expert_of(path)) is not None:
                i, e = expert
                within = path.split(f".experts.{e}.", 1)[1]  # `w1.weight_packed`
                experts[i].setdefault(e, []).append((within, info))
            elif path.startswith("model.layers."):
                index, rel = path[len("model.layers.") :].split(".", 1)
                i = int(index)
                if rel.startswith(("mlp.", "block_sparse_moe.")):
                    ffn[i].append((rel, info))
                else:
                    mixer[i].append((rel, info))
            elif path == "model.embed_tokens.weight":
                embed.append((path, info))
                if cfg.tie_word_embeddings:  # lm_head is the embedding: read again for the head
                    lm_head = info
            elif path == "lm_head.weight":
                lm_head = info
            else:
                head.append((path, info))
        self.embed = Stage("embed", None, None, _sorted(embed))
        self.vision: Stage | None = None  # the tower and the projector, when the checkpoint has them
        if cfg.vision_config is not None and any(n.startswith(VISION_PREFIXES) for n in found):
            tower = match_vision(cfg, found, ckpt.location)  # names each missing or mis-shaped tensor
            self.vision = Stage("vision", None, None, _sorted([(n, ckpt.info(n)) for n in tower]))
        self.head = Stage("head", None, None, _sorted(head))  # the output AttnRes read and the final norm
        # lm_head in blocks of vocabulary rows, each one read: the largest stage of K3 otherwise (2.35 GB)
        assert lm_head is not None  # match_layout requires it
        per_row = lm_head.nbytes // lm_head.shape[0]
        rows = max(1, HEAD_BLOCK_BYTES // per_row)
        self.lm_head = [
            Stage("lm_head", None, None, ((f"rows.{a}", _rows(lm_head, a, min(a + rows, lm_head.shape[0]))),))
            for a in range(0, lm_head.shape[0], rows)
        ]
        self.mixer = [Stage("mixer", i, None, _sorted(m)) for i, m in enumerate(mixer)]
        # a layer's FFN stages, in the order they are computed: one for a MoE layer (router, latent
        # projections, shared experts); gate, up, down for a dense MLP, each its own (layer 0's dense MLP is
        # K3's largest stage otherwise: 1.45 GB)
        self.ffn = [_ffn_stages(i, f) for i, f in enumerate(ffn)]
        self.experts = [
            {e: Stage("expert", i, e, _sorted(ts)) for e, ts in sorted(layer.items())}
            for i, layer in enumerate(experts)
        ]

    def embed_rows(self, ids: list[int]) -> Stage:
        """The rows of the embedding that these token ids (ascending, distinct) look up: one tensor a run
        of consecutive ids, named `rows.{first id}`, [run length, hidden]."""
        ((_, table),) = self.embed.tensors
        runs: list[list[int]] = []
        for t in ids:
            if runs and runs[-1][1] == t:
                runs[-1][1] = t + 1
            else:
                runs.append([t, t + 1])
        return Stage("embed", None, None, tuple((f"rows.{a}", _rows(table, a, b)) for a, b in runs))

    def expert_stages(self, layer: int, chosen: list[int]) -> list[Stage]:
        """The stages of the experts `chosen` in layer `layer`, in file-offset order."""
        return sorted((self.experts[layer][e] for e in chosen), key=lambda s: s.offset)

    @property
    def layer_bytes(self) -> int:
        """Bytes of the mixer, FFN and head stages: what every pass reads besides the embedding rows of its
        tokens and the routed experts its tokens choose."""
        return sum(s.nbytes for s in [*self.mixer, *self.ffn_stages, self.head, *self.lm_head])

    @property
    def ffn_stages(self) -> list[Stage]:
        return [stage for layer in self.ffn for stage in layer]

    def expert_bytes(self, layer: int, expert: int) -> int:
        return self.experts[layer][expert].nbytes
