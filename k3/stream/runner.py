"""The layer-major schedule: every prompt through layer i before any weight of layer i+1 is read.

Per pass (the prompts, then one pass per generated token):

    vision                     first pass, prompts with images only: read the tower and the projector, run
                               every image of every prompt through them at once (fp32); drop them
    embed                      read the embedding rows of the pass's tokens, look them up, drop them
                               (the image rows replace the `<|media_pad|>` embeddings, in order)
    for each layer i:
        mixer i                read norms + AttnRes + attention weights; every prompt through the mixer
        ffn i                  read the dense MLP, or router + latent projections + shared experts;
                               route every token of every prompt at once
        experts of layer i     read only the experts some token chose, in file order, a ring ahead; run
                               each on its tokens; drop it
        commit                 the streams after layer i (and its caches) to the scratch folder
    head                       read the output read, the final norm and lm_head; logits

One background thread reads the next stage while the current one computes (`k3.stream.fetch.Reads`), so
at any time memory holds at most the current stage, the one being read and the expert ring, plus the
prompts' state (which spills to the scratch folder beyond the budget). Everything runs under
`torch.inference_mode()`.
"""

from __future__ import annotations

import hashlib
import json
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from k3.errors import K3Error
from k3.model.attn_res import ResidualStream
from k3.model.model import K3DecoderLayer
from k3.stream.fetch import CheckpointWeights, MappedWeights, Reads, ReadStats, ResidentWeights, Tensors
from k3.stream.layer import (
    LayerState,
    empty_ends,
    empty_eyes,
    empty_layer,
    expert_dispatch,
    fill,
    head_block,
    new_state,
    release,
    route,
    run_mixer,
)
from k3.stream.plan import Stage, StreamPlan
from k3.stream.scratch import (
    STATE,
    Progress,
    Scratch,
    state_tensors,
    states_from,
    stream_tensors,
    streams_from,
)
from k3.vision.preprocess import Prepared
from k3.vision.prompt import expand_placeholders


class StreamError(K3Error):
    """Bad input to the streaming runner (prompts, options, a scratch folder of another job)."""


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StreamOptions:
    all_positions: bool = False  # logits of every position, not only the last
    max_new_tokens: int = 0  # greedy continuation: one more pass over the weights per token
    top_k: int = 5
    chunk_tokens: int = 2048  # the mixer runs long prompts this many tokens at a time
    memory_budget: int = 4 * 10**9  # bytes of prompt state kept in RAM; beyond, it lives in the scratch files
    prefetch_bytes: int = 256 * 2**20  # experts read ahead of the one computing (at least one)
    dump_hidden: tuple[int, ...] = ()  # layers whose output (the residual sum) is kept
    # the activations' dtype, "float32" or "bfloat16" (bf16 products with BF16 and MXFP4 weights, where the
    # CPU has bf16 dot products; logits are returned in fp32 either way)
    compute: str = "float32"

    def __post_init__(self) -> None:
        if self.compute not in COMPUTE_DTYPES:
            raise StreamError(f"compute must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute!r}")

    @property
    def passes(self) -> int:
        return max(1, self.max_new_tokens)

    @property
    def dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.compute]


@dataclass
class StreamStatus:
    """What the progress display shows; `fraction` of the whole job done."""

    pass_index: int
    passes: int
    layer: int | None
    layers: int
    stage: str
    stats: ReadStats
    fraction: float


@dataclass
class StreamResult:
    outputs: dict[str, torch.Tensor]  # logits, topk_ids, topk_logprobs, input_ids, lengths, generated, ...
    summary: dict = field(default_factory=dict)


def fingerprint(
    location: str,
    total_bytes: int,
    prompts: list[list[int]],
    options: StreamOptions,
    images: list[list[Prepared]] | None = None,
) -> str:
    """What a scratch folder must match to be resumed: the source, the prompts (and their images' pixels)
    and every option that changes the results (the memory budget and the prefetch depth do not: a resumed
    run may change them)."""
    kept = {k: v for k, v in options.__dict__.items() if k not in ("memory_budget", "prefetch_bytes")}
    job = {"source": location, "bytes": total_bytes, "prompts": prompts, "options": kept}
    if images and any(images):
        digest = [[hashlib.sha256(im.pixels.numpy().tobytes()).hexdigest() for im in p] for p in images]
        job["images"] = digest
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=list).encode()).hexdigest()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _padded(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """[T_p, ...] per prompt -> [P, length, ...], zeros after each prompt's end."""
    out = rows[0].new_zeros(len(rows), length, *rows[0].shape[1:])
    for p, r in enumerate(rows):
        out[p, : r.shape[0]] = r
    return out


class StreamRun:
    def __init__(
        self,
        plan: StreamPlan,
        weights: CheckpointWeights | MappedWeights | ResidentWeights,
        prompts: list[list[int]],
        options: StreamOptions,
        scratch: Scratch | None = None,
        report: Callable[[StreamStatus], None] | None = None,
        images: list[list[Prepared]] | None = None,
    ) -> None:
        """`images`: per prompt, the images (or clips) whose rows fill its `<|media_pad|>` placeholders in
        order (the expanded form, or one pad per image: expanded here)."""
        cfg = plan.config
        if not prompts or any(not p for p in prompts):
            raise StreamError("every prompt needs at least one token")
        self.images = images or [[] for _ in prompts]
        if len(self.images) != len(prompts):
            raise StreamError(f"{len(prompts)} prompts, images for {len(self.images)}")
        if any(self.images):
            if plan.vision is None:
                raise StreamError("prompts with images, but the checkpoint has no vision tower")
            pad = int(cfg.media_placeholder_token_id)
            try:
                prompts = [
                    expand_placeholders(p, pad, [im.tokens for im in ims]) if ims else p
                    for p, ims in zip(prompts, self.images, strict=True)
                ]
            except K3Error as e:
                raise StreamError(f"a prompt with images: {e}") from None
        bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise StreamError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
        wrong = [i for i in options.dump_hidden if not 0 <= i < plan.num_layers]
        if wrong:
            raise StreamError(f"--dump-hidden: no layer {wrong[0]} (layers 0..{plan.num_layers - 1})")
        self.plan, self.cfg, self.prompts, self.options = plan, cfg, prompts, options
        self.scratch, self.report = scratch, report
        self.stats = ReadStats()
        self.reads = Reads(weights, self.stats)
        n = plan.num_layers
        self.caches: list[list[LayerState] | None] = [None] * n  # per layer, per prompt (when generating)
        self.pass_index = 0
        self.outputs: dict[str, torch.Tensor] = {}
        self.experts_touched: list[dict[int, list[int]]] = []  # per pass: layer -> experts read
        self.generated: list[list[int]] = [[] for _ in prompts]  # greedy tokens so far, per prompt
        self.dense_bytes_per_pass: list[int] = []  # planned: layers + head + the embedding rows of its tokens
        self.spills = 0  # times state left RAM for its scratch file (a layer's caches, or the streams)

    # ---- the schedule -------------------------------------------------------------------------------
    def run(self) -> StreamResult:
        started = time.perf_counter()
        progress = self.scratch.progress() if self.scratch is not None else None
        streams: list[ResidualStream] | None = None
        start_layer = 0
        if progress is not None:
            assert self.scratch is not None
            self.pass_index, self.generated = progress.pass_index, progress.generated
            start_layer = progress.layer + 1
            if progress.layer >= 0:
                streams = streams_from(
                    self.scratch.read(STATE), len(self.prompts), self.cfg.attn_res_block_size
                )
            if self.pass_index > 0:
                self.outputs = dict(self.scratch.read("outputs.safetensors"))
        try:
            with torch.inference_mode():
                while self.pass_index < self.options.passes:
                    tokens = self.prompts if self.pass_index == 0 else [[g[-1]] for g in self.generated]
                    last = self._pass(tokens, start_layer, streams)  # [P, V] last-position logits
                    for p, row in enumerate(last):
                        self.generated[p].append(int(row.argmax()))
                    self.pass_index += 1
                    start_layer, streams = 0, None
                    if self.scratch is not None and self.pass_index < self.options.passes:
                        self.scratch.commit(Progress(self.pass_index, -1, self.generated), [])
        finally:
            self.reads.close()
        self._finish_outputs(self.generated)
        return StreamResult(self.outputs, self._summary(time.perf_counter() - started))

    def _pass(
        self, tokens: list[list[int]], start_layer: int, streams: list[ResidualStream] | None
    ) -> torch.Tensor:
        plan = self.plan
        self.experts_touched.append({})
        if streams is None:
            streams = self._embed(tokens)
        for i in range(start_layer, plan.num_layers):
            streams = self._layer(i, streams)
        return self._head(streams)

    def _status(self, stage: Stage) -> None:
        if self.report is None:
            return
        L = self.plan.num_layers
        layer = stage.layer if stage.layer is not None else (-1 if stage.kind in ("vision", "embed") else L)
        done = (self.pass_index * (L + 2) + layer + 1) / (self.options.passes * (L + 2))
        self.report(
            StreamStatus(self.pass_index, self.options.passes, stage.layer, L, stage.label, self.stats, done)
        )

    def _take(self, stage: Stage) -> Tensors:
        self._status(stage)
        return self.reads.take(stage)

    def _vision(self, then: Stage) -> list[torch.Tensor]:
        """Every image of every prompt through the tower and the projector at once, in fp32 (as
        K3ForConditionalGeneration's default `vision_dtype`), `then` read meanwhile: per prompt its rows
        [pads, H] in order (empty without images)."""
        stage = self.plan.vision
        assert stage is not None
        tensors = self._take(stage)
        self.reads.ahead(then)
        eyes = empty_eyes(self.cfg)
        fill(eyes, {name: t.float() for name, t in tensors.items()})  # BF16 in the files: exact in fp32
        items = [im for ims in self.images for im in ims]
        pixels = torch.cat([im.pixels for im in items])  # [patches of all items, 3, P, P]
        rows = eyes.mm_projector(eyes.vision_tower(pixels, [im.grid for im in items]))  # per item [n, H]
        del eyes, tensors
        self.reads.done(stage)
        out, k = [], 0
        for ims in self.images:
            out.append(torch.cat([rows[k + j] for j in range(len(ims))]) if ims else pixels.new_zeros(0))
            k += len(ims)
        return out

    def _embed(self, tokens: list[list[int]]) -> list[ResidualStream]:
        """Every prompt's embeddings, from the rows of the table its tokens use (the only ones read); on the
        first pass, the pads' rows replaced by their images' (the vision stage)."""
        ids = sorted({t for p in tokens for t in p})
        stage = self.plan.embed_rows(ids)
        with_images = self.pass_index == 0 and any(self.images)
        vision_bytes = self.plan.vision.nbytes if with_images and self.plan.vision is not None else 0
        self.dense_bytes_per_pass.append(self.plan.layer_bytes + stage.nbytes + vision_bytes)
        image_rows = self._vision(stage) if with_images else None
        tensors = self._take(stage)
        self.reads.ahead(self.plan.mixer[0])
        table = torch.cat([tensors[name] for name, _ in stage.tensors])  # [len(ids), H], rows of `ids`
        self.reads.done(stage)
        row = {t: i for i, t in enumerate(ids)}
        streams = []
        for p, prompt in enumerate(tokens):
            rows = torch.tensor([[row[t] for t in prompt]])
            x = F.embedding(rows, table).to(self.options.dtype)  # [1, T, H]
            if image_rows is not None and len(image_rows[p]):  # as K3ForConditionalGeneration.embed
                x[0, torch.tensor(prompt) == self.cfg.media_placeholder_token_id] = image_rows[p].to(x.dtype)
            streams.append(ResidualStream(x, self.cfg.attn_res_block_size))
        return streams

    def _layer_states(self, i: int) -> list[LayerState] | list[None]:
        if self.options.passes == 1:
            return [None] * len(self.prompts)  # nothing to continue: no cache kept
        if self.pass_index == 0:
            return [new_state(self.cfg, i) for _ in self.prompts]
        states = self.caches[i]
        if states is None:  # spilled: read back from the previous pass's file
            assert self.scratch is not None
            like = [new_state(self.cfg, i) for _ in self.prompts]
            states = states_from(self.scratch.read(f"cache.{i}.{self.pass_index - 1}.safetensors"), like)
        return states

    def _layer(self, i: int, streams: list[ResidualStream]) -> list[ResidualStream]:
        plan, cfg, H = self.plan, self.cfg, self.cfg.hidden_size
        layer = empty_layer(cfg, i)
        mixer = self._take(plan.mixer[i])
        self.reads.ahead(plan.ffn[i][0])
        fill(layer, mixer)
        states = self._layer_states(i)
        ffn_inputs = [
            run_mixer(cfg, layer, s, st, self.options.chunk_tokens)
            for s, st in zip(streams, states, strict=True)  # [1, T_p, H] each
        ]
        release(layer, mixer)
        self.reads.done(plan.mixer[i])
        del mixer
        sizes = [f.shape[1] for f in ffn_inputs]
        x = torch.cat([f.reshape(-1, H) for f in ffn_inputs])  # [N, H], all prompts' tokens
        del ffn_inputs
        following = plan.mixer[i + 1] if i + 1 < plan.num_layers else plan.head
        if not layer.is_moe:
            out = self._mlp(layer, x, plan.ffn[i], following)
        else:
            (stage,) = plan.ffn[i]
            ffn = self._take(stage)
            fill(layer, ffn)
            moe = layer.block_sparse_moe
            weights, indices, z = route(moe, x)
            r = expert_dispatch(moe, z, weights, indices, lambda chosen: self._experts(i, chosen, following))
            out = moe.finish(x, r)
            release(layer, ffn)
            self.reads.done(stage)
        for s, part in zip(streams, out.split(sizes), strict=True):
            s.add(part.view(1, -1, H))
        if self.pass_index == 0 and i in self.options.dump_hidden:
            self._dump_hidden(i, streams)
        if states[0] is not None:
            self.caches[i] = states  # type: ignore[assignment]
        return self._commit(i, streams)

    def _mlp(
        self, layer: K3DecoderLayer, x: torch.Tensor, stages: tuple[Stage, ...], following: Stage
    ) -> torch.Tensor:
        """`MLP.forward` of x [N, H], down(act(gate(x), up(x))), with gate, up and down each its own stage
        (k3.stream.plan.MLP_ORDER), the next one read while this one computes."""
        gate, up, down = stages
        g = self._project(layer, gate, up, x)  # [N, m]
        u = self._project(layer, up, down, x)  # [N, m]
        return self._project(layer, down, following, layer.mlp.act(g, u))  # [N, H]

    def _project(self, layer: K3DecoderLayer, stage: Stage, then: Stage, x: torch.Tensor) -> torch.Tensor:
        """x times the one matrix of `stage` (a Linear of `layer`), with `then` read meanwhile."""
        tensors = self._take(stage)
        self.reads.ahead(then)
        fill(layer, tensors)
        ((name, _),) = stage.tensors  # `mlp.gate_proj.weight`
        y = layer.get_submodule(name.rsplit(".", 1)[0])(x)
        release(layer, tensors)
        self.reads.done(stage)
        return y

    def _experts(self, i: int, chosen: list[int], following: Stage) -> Iterator[tuple[int, Tensors]]:
        """(expert, tensors) in file order, reading `prefetch_bytes` ahead, then the next stage."""
        stages = self.plan.expert_stages(i, chosen)
        self.experts_touched[-1][i] = sorted(chosen)
        ring = max(1, self.options.prefetch_bytes // max(stages[0].nbytes, 1))
        asked = 0

        def ask_until(n: int) -> None:
            nonlocal asked
            while asked < min(n, len(stages)):
                self.reads.ahead(stages[asked])
                asked += 1
                if asked == len(stages):
                    self.reads.ahead(following)

        ask_until(ring)
        for j, stage in enumerate(stages):
            tensors = self._take(stage)
            ask_until(j + 1 + ring)
            yield stage.expert, tensors  # type: ignore[misc]
            self.reads.done(stage)

    def _head(self, streams: list[ResidualStream]) -> torch.Tensor:
        ends = empty_ends(self.cfg)
        tensors = self._take(self.plan.head)
        self.reads.ahead(self.plan.lm_head[0])
        fill(ends, tensors)
        keep_all = self.pass_index == 0 and self.options.all_positions
        h = [ends.model.output(s)[0] for s in streams]  # [T, H] per prompt
        h = h if keep_all else [x[-1:] for x in h]  # [T or 1, H]
        release(ends, tensors)
        self.reads.done(self.plan.head)
        sizes = [x.shape[0] for x in h]
        x = torch.cat(h)  # [rows, H]: every prompt's rows at once, for each block of lm_head
        columns = []
        for j, stage in enumerate(self.plan.lm_head):  # vocabulary rows a block at a time, the next one read
            block = self._take(stage)
            if j + 1 < len(self.plan.lm_head):
                self.reads.ahead(self.plan.lm_head[j + 1])
            ((_, weight),) = block.items()  # [rows of the block, H]
            head = head_block(weight)
            columns.append(head(x).float())  # [rows, block]
            del head, block, weight
            self.reads.done(stage)
        logits = list(torch.cat(columns, dim=-1).split(sizes))  # per prompt [T or 1, V]
        if self.pass_index == 0:
            self._first_outputs(logits)
        return torch.stack([row[-1] for row in logits])  # [P, V]

    # ---- state ----------------------------------------------------------------------------------------
    def _commit(self, i: int, streams: list[ResidualStream]) -> list[ResidualStream]:
        if self.scratch is None:
            return streams
        generating = self.caches[i] is not None
        if generating:
            self.scratch.write_cache(i, self.pass_index, self.caches[i])  # type: ignore[arg-type]
        self.scratch.commit(Progress(self.pass_index, i, self.generated), streams)
        if generating:  # the previous pass's file is needed until this layer is committed
            self.scratch.drop_cache(i, self.pass_index - 1)
        stream_bytes = _nbytes(stream_tensors(streams))
        cache_bytes = sum(_nbytes(state_tensors(c)) for c in self.caches if c is not None)
        if generating and stream_bytes + cache_bytes > self.options.memory_budget:
            self.caches[i] = None  # read back from its file at the next pass
            self.spills += 1
        if stream_bytes > self.options.memory_budget:  # the streams as views of the file just written
            self.spills += 1
            return streams_from(self.scratch.read(STATE), len(self.prompts), self.cfg.attn_res_block_size)
        return streams

    def _dump_hidden(self, i: int, streams: list[ResidualStream]) -> None:
        rows = [sum(s.blocks, torch.zeros_like(s.partial)) + s.partial for s in streams]  # type: ignore[arg-type]
        tensor = _padded([r[0] for r in rows], max(len(p) for p in self.prompts))  # [P, T, H]
        if self.scratch is not None:
            self.scratch.write(f"hidden.{i}.safetensors", {"hidden": tensor})
        else:
            self.outputs[f"hidden.{i}"] = tensor

    def _first_outputs(self, logits: list[torch.Tensor]) -> None:
        k = min(self.options.top_k, self.cfg.vocab_size)
        if self.options.all_positions:
            full = _padded(logits, max(len(p) for p in self.prompts))  # [P, T, V]
        else:
            full = torch.cat(logits)  # [P, V]
        logprobs = torch.log_softmax(full, dim=-1)
        top = logprobs.topk(k, dim=-1)
        self.outputs.update(logits=full, topk_ids=top.indices, topk_logprobs=top.values)
        if self.scratch is not None:
            self.scratch.write("outputs.safetensors", self.outputs)

    def _finish_outputs(self, generated: list[list[int]]) -> None:
        self.outputs["lengths"] = torch.tensor([len(p) for p in self.prompts], dtype=torch.long)
        self.outputs["input_ids"] = _padded(
            [torch.tensor(p) for p in self.prompts], max(map(len, self.prompts))
        )
        if self.options.max_new_tokens:
            self.outputs["generated"] = torch.tensor(generated, dtype=torch.long)
        for i in self.options.dump_hidden:
            if self.scratch is not None:
                self.outputs[f"hidden.{i}"] = self.scratch.read(f"hidden.{i}.safetensors")["hidden"].clone()

    def _summary(self, seconds: float) -> dict:
        s = self.stats
        return {
            "passes": self.options.passes,
            "compute": self.options.compute,
            "prompts": len(self.prompts),
            "tokens": sum(map(len, self.prompts)),
            "bytes_read": s.bytes_read,
            "bytes_dense": s.bytes_dense,
            "bytes_experts": s.bytes_experts,
            "dense_bytes_per_pass": self.dense_bytes_per_pass,
            "reads": s.reads,
            "experts_touched": [{str(k): len(v) for k, v in p.items()} for p in self.experts_touched],
            "experts_touched_ids": [{str(k): v for k, v in p.items()} for p in self.experts_touched],
            "seconds": seconds,
            "seconds_reading": s.seconds_reading,
            "seconds_waiting_for_reads": s.seconds_waiting,
            "seconds_compute": seconds - s.seconds_waiting,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "scratch_bytes_written": self.scratch.bytes_written if self.scratch is not None else 0,
            "state_spills": self.spills,
        }
