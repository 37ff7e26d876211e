"""The engine's commands: `k3 tokenize`, `k3 generate`, `k3 chat`, `k3 serve` (typer functions; heavy
imports happen inside them so `k3 --help` stays fast)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import typer
from rich.console import Console

from k3.terminal import fail

console = Console()


def _show_bytes(piece: bytes) -> str:
    """A token's bytes as text, or as \\x escapes where they are not (yet) a whole UTF-8 character."""
    try:
        return repr(piece.decode("utf-8"))[1:-1]
    except UnicodeDecodeError:
        return "".join(chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}" for b in piece)


def tokenize(
    text: str = typer.Argument(..., help="The text to split into tokens."),
    checkpoint: str = typer.Option(
        None,
        "--checkpoint",
        "-c",
        help="Checkpoint directory with tiktoken.model (default: the built-in BPE).",
    ),
    vocab_size: int = typer.Option(
        32768,
        "--vocab-size",
        help="Size of the built-in tokenizer when no checkpoint is given (mini: 32768).",
    ),
    special: bool = typer.Option(
        False, "--special", help="Read special-token text (<|open|>...) as specials."
    ),
    chat: bool = typer.Option(
        False,
        "--chat",
        help="TEXT is a chat as JSON: a list of messages, or /tokenize's body (messages, tools, "
        "add_generation_prompt, chat_template_kwargs...): the ids `k3 serve` prefills for it.",
    ),
    ids_only: bool = typer.Option(False, "--ids", help="Print only the token ids, as a JSON list."),
) -> None:
    """Show how TEXT splits into tokens: one row per token with its id and bytes."""
    import json

    from rich.table import Table
    from rich.text import Text

    from k3.errors import K3Error
    from k3.tokenizer.build import builtin_tokenizer
    from k3.tokenizer.kimi import Tokenizer

    try:
        tok = Tokenizer.from_source(checkpoint) if checkpoint else builtin_tokenizer(vocab_size)
        if chat:
            ids = chat_ids(tok, text)
            pieces = [(i, tok.token_bytes(i)) for i in ids]
        else:
            pieces = tok.pieces(text, allowed_special="all" if special else frozenset())
    except K3Error as e:
        fail(str(e))
    if ids_only:
        print(json.dumps([i for i, _ in pieces]))
        return
    source = checkpoint or f"built-in BPE, vocab {vocab_size}"
    table = Table(title=Text(f"{len(pieces)} tokens ({source})"), title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("id", justify="right")
    table.add_column("piece")
    table.add_column("bytes", justify="right")
    for n, (token_id, piece) in enumerate(pieces):
        shown = Text(
            _show_bytes(piece).replace(" ", "␣"), style="magenta" if tok.is_special(token_id) else ""
        )
        table.add_row(str(n), str(token_id), shown, str(len(piece)))
    console.print(table)
    console.print(Text(" · ".join(_show_bytes(p) for _, p in pieces)))


def chat_ids(tok, text: str) -> list[int]:
    """The prompt ids of a chat given as JSON (a message list or a /tokenize body), or a K3Error."""
    import json

    from pydantic import ValidationError

    from k3.engine.chat import request_prompt
    from k3.engine.protocol import TokenizeBody
    from k3.errors import K3Error

    try:
        request = json.loads(text)
        body = TokenizeBody.model_validate({"messages": request} if isinstance(request, list) else request)
    except (ValueError, ValidationError) as e:
        raise K3Error(f"--chat: TEXT is not a chat request ({str(e).splitlines()[0]})") from e
    if body.messages is None:
        raise K3Error("--chat: TEXT has no messages")
    return request_prompt(body, body.messages).ids(tok, body.add_generation_prompt)


def load(
    checkpoint: str,
    layers: int | None,
    int8_expert_inputs: bool = False,
    bf16_products: bool = False,
    threads: int | None = None,
):
    """Model (BF16 weights tiled for decode, or paired for bf16 products: k3.model.tiling; MXFP4 experts
    exact, or with their inputs rounded to int8) + tokenizer of a checkpoint directory or URL, or a one-line
    error. `threads`: torch's thread count from here on (None: torch's default, one a usable core)."""
    import torch

    from k3.checkpoint import open_checkpoint
    from k3.errors import K3Error
    from k3.model import K3ForCausalLM, K3ForConditionalGeneration
    from k3.tokenizer.kimi import Tokenizer

    if threads is not None:
        if threads < 1:
            fail(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if "://" not in checkpoint and not Path(checkpoint).exists():
        fail(f"{checkpoint}: no such directory")
    try:
        with open_checkpoint(checkpoint) as ckpt:  # a config with vision_config: the tower too
            vision = ckpt.config is not None and ckpt.config.vision_config is not None
            pinned = ckpt.location  # a Hub source: hf://ORG/REPO@<commit>, so all three read one commit
        model_class = K3ForConditionalGeneration if vision else K3ForCausalLM
        model = model_class.from_pretrained(pinned, layers=layers)
        model.tile_weights(bf16_products)  # for the decode kernels (k3.model.tiling; exact by default)
        model.set_int8_expert_inputs(int8_expert_inputs)
        model.set_native_activations(True)  # inference: the activations in one native pass
        tokenizer = Tokenizer.from_source(model.source)
    except (K3Error, OSError) as e:
        fail(f"{e}")
    if tokenizer.vocab_size != model.config.vocab_size:
        fail(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.config.vocab_size}"
        )
    return model, tokenizer


def sampling_params(
    max_tokens: int, temperature: float, top_k: int, top_p: float, penalty: float, seed: int | None, stop
):
    from k3.engine.sampling import SamplingParams
    from k3.errors import K3Error

    try:
        return SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=penalty,
            max_tokens=max_tokens,
            stop_ids=frozenset(stop),
            seed=seed,
        )
    except K3Error as e:
        fail(str(e))


MAX_TOKENS = typer.Option(128, "--max-tokens", "-n", help="Most tokens to generate.")
TEMPERATURE = typer.Option(0.7, "--temperature", "-t", help="0 = greedy.")
TOP_K = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0 = off).")
TOP_P = typer.Option(0.95, "--top-p", help="Nucleus sampling mass (1 = off).")
PENALTY = typer.Option(1.0, "--repetition-penalty", help="Over 1 discourages repeating tokens (1 = off).")
SEED = typer.Option(None, "--seed", help="Seed for reproducible sampling.")
LAYERS = typer.Option(None, "--layers", help="Run only the first N layers (a depth-truncated model).")
INT8_EXPERTS = typer.Option(
    False,
    "--int8-expert-inputs",
    help="MXFP4 experts multiply their inputs rounded to int8 per block of 32: approximate (as llama.cpp), "
    "a faster decode where vector units are narrow (AVX2-only CPUs). Default: exact.",
)
BF16_PRODUCTS = typer.Option(
    False,
    "--bf16-products",
    help="Decode steps multiply the BF16 weights by their inputs rounded to bfloat16 (bf16 dot products, "
    "fp32 sums): approximate, a faster step of several sequences. CPUs with AVX-512 BF16. Default: exact.",
)
THREADS = typer.Option(
    None,
    "--threads",
    help="CPU threads for the model (default: one a usable core). Where other processes keep cores busy, "
    "fewer can be faster, a small model's decode most: docs/native-cpus.md 'A shared machine'.",
)
IMAGES = typer.Option(None, "--image", help="An image before the prompt (repeat for more); needs a tower.")


def load_images(paths: list | None) -> list:
    """k3.engine.images.ImageInput per path, or a one-line error naming the file and the problem."""
    from k3.engine.images import load_image
    from k3.errors import K3Error

    out = []
    for path in paths or []:
        try:
            out.append(load_image(path.read_bytes()))
        except (K3Error, OSError) as e:
            fail(f"{path}: {e}")
    return out


def generate(
    checkpoint: str = typer.Argument(..., help="Checkpoint directory, http(s) URL or hf://ORG/REPO[@REV]."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Text to continue."),
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    repetition_penalty: float = PENALTY,
    seed: int = SEED,
    layers: int = LAYERS,
    int8_expert_inputs: bool = INT8_EXPERTS,
    bf16_products: bool = BF16_PRODUCTS,
    threads: int = THREADS,
    image: list[Path] = IMAGES,
) -> None:
    """Continue a prompt (plain completion, no chat format), streaming tokens to the terminal; `--image`:
    the images' prompts (media tokens, size, pads) come first."""
    images = load_images(image)
    model, tok = load(checkpoint, layers, int8_expert_inputs, bf16_products, threads)
    params = sampling_params(
        max_tokens, temperature, top_k, top_p, repetition_penalty, seed, {tok.special.eos}
    )
    prompt_tokens, count, elapsed = complete_to(sys.stdout, model, tok, prompt, params, images)
    Console(stderr=True).print(f"[dim]{rate_line(prompt_tokens, count, elapsed)}[/]")


def complete_to(out: TextIO, model, tok, prompt: str, params, images=None) -> tuple[int, int, float]:
    """Write the prompt and its continuation to `out` as the tokens come; returns (prompt tokens,
    generated tokens, seconds). `images` (ImageInput) go before the prompt."""
    import time

    from k3.engine.generate import Engine
    from k3.engine.images import image_prompt_ids
    from k3.errors import K3Error
    from k3.tokenizer.kimi import StreamDecoder

    if images and not hasattr(model, "encode_images"):
        fail("--image: this checkpoint has no vision tower (its config has no vision_config)")
    ids = [t for im in images or [] for t in image_prompt_ids(tok, im)] + tok.encode(prompt)
    if not ids:
        fail("the prompt is empty")
    decoder = StreamDecoder(tok)
    out.write(prompt)
    start, count = time.perf_counter(), 0
    try:
        for token in Engine(model).stream(ids, params, images):
            out.write(decoder.push(token))
            out.flush()
            count += 1
    except K3Error as e:
        fail(str(e))
    out.write(decoder.flush() + "\n")
    return len(ids), count, time.perf_counter() - start


def rate_line(prompt_tokens: int, count: int, elapsed: float) -> str:
    return (
        f"{prompt_tokens} prompt tokens, {count} generated in {elapsed:.2f} s "
        f"({count / max(elapsed, 1e-9):.1f} tokens/s)"
    )


def chat(
    checkpoint: str = typer.Argument(..., help="Checkpoint directory, http(s) URL or hf://ORG/REPO[@REV]."),
    system: str = typer.Option(None, "--system", help="A system message to start the conversation."),
    tools: Path = typer.Option(
        None, "--tools", help="A JSON file with OpenAI tool declarations the model may call."
    ),
    thinking: bool = typer.Option(True, "--thinking/--no-thinking", help="Let the model think first."),
    effort: str = typer.Option("max", "--effort", help="Thinking effort: low, medium, high or max."),
    max_tokens: int = MAX_TOKENS,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    repetition_penalty: float = PENALTY,
    seed: int = SEED,
    layers: int = LAYERS,
    int8_expert_inputs: bool = INT8_EXPERTS,
    bf16_products: bool = BF16_PRODUCTS,
    threads: int = THREADS,
    image: list[Path] = typer.Option(
        None, "--image", help="An image for the first user turn (repeat for more); needs a tower."
    ),
) -> None:
    """Talk to a model: one line per user turn (reads stdin until EOF; empty lines are skipped).
    The reasoning (think channel) is shown dimmed, then the answer, then each tool call; after calls,
    each line is the result of the next call (`tool NAME>`). `--image` and a line `/image PATH` attach
    images to the next user turn (before its text, as image_url parts in the server's chat format)."""
    import json

    from k3.chat.encoder import encode_chat
    from k3.chat.parser import ReplyParser
    from k3.engine.chat import ChatRequestError, check_tools
    from k3.engine.generate import Engine
    from k3.vision.prompt import image_prompt

    declared = None
    if tools is not None:
        try:
            declared = json.loads(tools.read_text())
        except (OSError, ValueError) as e:
            fail(f"--tools {tools}: cannot read a JSON list of tools ({e})")
        try:
            check_tools(declared, None)
        except ChatRequestError as e:
            fail(f"--tools {tools}: {e}")
    attached = load_images(image)  # images for the next user turn (k3.engine.images.ImageInput)
    model, tok = load(checkpoint, layers, int8_expert_inputs, bf16_products, threads)
    if attached and not hasattr(model, "encode_images"):
        fail("--image: this checkpoint has no vision tower (its config has no vision_config)")
    params = sampling_params(
        max_tokens,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        seed,
        {tok.special.eos, tok.special.end_of_msg},
    )
    engine = Engine(model)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    options = {"thinking": thinking, "thinking_effort": effort}
    encode_chat(tok, history, declared, **options)  # a bad --effort or --tools fails before the first turn
    interactive = sys.stdin.isatty()
    out = Console(highlight=False, soft_wrap=True, markup=False)  # model text is never rich markup
    pending: list = []  # tool calls waiting for their results
    images: list = []  # every image of the conversation so far, in order (the engine caches their rows)
    while True:
        ask = f"tool {pending[0].name}> " if pending else "you> "
        try:
            line = input(ask if interactive else "")
        except EOFError:
            break
        if not line.strip():
            continue
        if not interactive:
            out.print(f"{ask}{line}")
        if not pending and line.startswith("/image "):
            attached += attach(out, model, Path(line[len("/image ") :].strip()))
            continue
        if pending:
            call = pending.pop(0)
            history.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": line})
            if pending:
                continue
        elif attached:  # the images' parts first, then the text (k3.engine.server's chat format)
            parts: list[dict] = [{"type": "image_url", "image_url": {"url": im.key}} for im in attached]
            history.append({"role": "user", "content": [*parts, {"type": "text", "text": line}]})
            images, attached = images + attached, []
        else:
            history.append({"role": "user", "content": line})
        reply = ReplyParser(tok, thinking)
        out.print("k3> ", end="")
        prompts = [image_prompt(im.original, im.tokens) for im in images] if images else None
        ids = encode_chat(tok, history, declared, image_prompts=prompts, **options)
        for token in engine.stream(ids, params, images or None):
            show(out, reply.push(token))
            if reply.done:
                break
        show(out, reply.flush())
        out.print()
        r = reply.reply()
        turn: dict = {"role": "assistant", "content": r.content, "reasoning_content": r.reasoning}
        if r.tool_calls:
            turn["tool_calls"] = [c.openai() for c in r.tool_calls]
        history.append(turn)
        pending = list(r.tool_calls)


def attach(out: Console, model, path: Path) -> list:
    """`/image PATH` in `k3 chat`: the image for the next user turn, or a one-line message and nothing."""
    from k3.engine.images import load_image
    from k3.errors import K3Error

    if not hasattr(model, "encode_images"):
        out.print("/image: this checkpoint has no vision tower (its config has no vision_config)")
        return []
    try:
        image = load_image(path.read_bytes())
    except (K3Error, OSError) as e:
        out.print(f"/image {path}: {e}")
        return []
    out.print(f"[{path.name}: {image.original[0]}x{image.original[1]}, {image.tokens} tokens, next turn]")
    return [image]


def show(out: Console, delta) -> None:
    """A reply's delta on the terminal: reasoning dimmed, content plain, tool calls in bold."""
    if delta.reasoning:
        out.print(delta.reasoning, style="dim", end="")
    if delta.content:
        out.print(delta.content, end="")
    for call in delta.tool_calls:
        out.print(f"\n[tool call {call.id}] {call.name}({call.arguments})", style="bold", end="")


def serve(
    checkpoint: str = typer.Argument(..., help="Checkpoint directory, http(s) URL or hf://ORG/REPO[@REV]."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    model_name: str = typer.Option(
        None, "--model-name", help="Model id in the API (default: the directory name)."
    ),
    max_batch: int = typer.Option(16, "--max-batch", help="Most sequences decoded together."),
    max_queue: int = typer.Option(
        64, "--max-queue", help="Requests that may wait beyond the batch (then 429 with Retry-After)."
    ),
    request_timeout: float = typer.Option(
        None, "--request-timeout", help="Seconds a request may take before it is cancelled (then 504)."
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar="K3_API_KEY",
        help="Require `Authorization: Bearer KEY` on every request (or set K3_API_KEY).",
    ),
    prefix_cache: bool = typer.Option(
        True, "--prefix-cache/--no-prefix-cache", help="Reuse the states of earlier prompts' prefixes."
    ),
    state_interval: int = typer.Option(
        2048, "--state-interval", help="Prefix cache: keep the state every this many prompt tokens."
    ),
    prefix_cache_bytes: int = typer.Option(
        2**30, "--prefix-cache-bytes", help="Prefix cache: most bytes of states kept (least recent go)."
    ),
    state_dir: str = typer.Option(
        None, "--state-dir", help="Prefix cache: keep the states in this folder too, read back at start."
    ),
    layers: int = LAYERS,
    int8_expert_inputs: bool = INT8_EXPERTS,
    bf16_products: bool = BF16_PRODUCTS,
    threads: int = THREADS,
    allow_remote_images: bool = typer.Option(
        False,
        "--allow-remote-images",
        help="Fetch http(s) image URLs from public addresses (size-capped, 10 s timeout).",
    ),
    private_image_hosts: list[str] = typer.Option(
        [],
        "--private-image-hosts",
        help="With --allow-remote-images: a host whose private address may serve images (repeatable).",
    ),
    max_images: int = typer.Option(8, "--max-images", help="Most images in one request."),
    max_image_tokens: int = typer.Option(
        None, "--max-image-tokens", help="Most tokens one image may take after resizing (default: any)."
    ),
    max_request_mb: int = typer.Option(
        64, "--max-request-mb", help="Most MiB in a request's body (then 413): images as data URLs count."
    ),
) -> None:
    """Serve a checkpoint over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /tokenize, /detokenize). Binds 127.0.0.1 unless --host says otherwise; another address needs
    --api-key. Chat messages may hold `image_url` parts (data URLs) when the checkpoint has a vision tower."""

    from k3.engine.generate import Engine
    from k3.engine.remote_images import RemoteImages
    from k3.engine.server import create_app
    from k3.errors import K3Error
    from k3.listen import listening_socket, require_key_beyond_this_machine, run_app, url_of

    if request_timeout is not None and not request_timeout > 0:
        fail(f"--request-timeout must be > 0 seconds, got {request_timeout}")
    if max_request_mb < 1:
        fail(f"--max-request-mb must be >= 1, got {max_request_mb}")
    if private_image_hosts and not allow_remote_images:
        fail("--private-image-hosts names hosts for remote images: it needs --allow-remote-images")
    if max_batch < 1 or max_queue < 0:
        fail(f"--max-batch must be >= 1 and --max-queue >= 0, got {max_batch} and {max_queue}")
    try:
        sock = listening_socket(host, port)
        require_key_beyond_this_machine(sock, host, api_key, "give a key with --api-key KEY (or K3_API_KEY)")
    except K3Error as e:
        fail(str(e))
    model, tok = load(checkpoint, layers, int8_expert_inputs, bf16_products, threads)
    name = model_name or (
        checkpoint.rstrip("/").rsplit("/", 1)[-1] if "://" in checkpoint else Path(checkpoint).resolve().name
    )
    cache = None
    if prefix_cache:
        cache = prefix_cache_of(model, state_interval, prefix_cache_bytes, state_dir)
    elif state_dir is not None:
        fail(
            "--state-dir keeps the prefix cache's states: it needs the prefix cache (drop --no-prefix-cache)"
        )
    app = create_app(
        Engine(model, max_batch=max_batch, prefix_cache=cache),
        tok,
        name,
        max_queue=max_queue,
        request_timeout=request_timeout,
        api_key=api_key,
        remote_images=RemoteImages(frozenset(private_image_hosts)) if allow_remote_images else None,
        max_images=max_images,
        max_image_tokens=max_image_tokens,
        max_request_bytes=max_request_mb * 2**20,
    )
    print(f"k3 serve: {name} on {url_of(sock)}v1", flush=True)
    run_app(app, sock, "info")


def prefix_cache_of(model, interval: int, max_bytes: int, state_dir: str | None):
    """The serve command's prefix cache (a one-line error for bad flags); logs what it read back."""
    import logging

    from k3.engine.prefix_cache import PrefixCache
    from k3.engine.state_store import checkpoint_identity
    from k3.errors import K3Error

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    try:
        return PrefixCache(interval, max_bytes, checkpoint_identity(model), state_dir)
    except (K3Error, OSError) as e:
        fail(str(e))
