"""The traps of the published K3 configs, found and named: one warning line each, each handled the way the
reference (Moonshot's modeling code, run by transformers) handles it (../shared/spec/checkpoints.md 9).

    for line in config_traps(raw_config, headers, added_tokens):   # strings, in a fixed order
        log.warning(line)

    trap (where seen)                          what k3 does (as the reference)
    no gate_lower_bound (0.40B)                the unbounded gate -exp(A_log) * softplus(f + dt_bias)
    head_dim in text_config (0.40B: 74)        ignored: MLA widths are qk_*_head_dim and v_head_dim
    rope_theta / rope_parameters (0.40B)       ignored: K3's MLA has no rotary embedding (NoPE)
    bos/eos/pad ordinary tokens (0.40B: 1/2/0) the tokenizer's special ids (the engine's)
    added tokens past vocab_size (0.40B)       no embedding row: never produced
    floating tensors all F32 (0.40B family)    read as stored (`dtype=` converts)
    quantization_config at the top level       read from there
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("k3.checkpoint")

NUM_SPECIAL_IDS = 256  # ids after the BPE ranks: K3's specials sit at vocab_size - 256 and above
_FLOATS = ("F32", "BF16", "F16", "F64")


def config_traps(
    raw: Mapping[str, Any] | None,
    headers: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    added_tokens: Mapping[str, int] | None = None,
) -> list[str]:
    """Every trap of this config.json (and, given them, its tensors' dtypes and `added_tokens.json`)."""
    if not isinstance(raw, Mapping):
        return []
    text = raw.get("text_config", raw)
    if not isinstance(text, Mapping):
        return []
    lin = text.get("linear_attn_config") or {}
    traps = []
    if text.get("routed_expert_hidden_size") is not None and "gate_lower_bound" not in lin:
        traps.append(
            "linear_attn_config.gate_lower_bound is absent: KDA runs the unbounded gate "
            "-exp(A_log) * softplus(f + dt_bias), as the reference does (not a default of -5)"
        )
    if "head_dim" in text:
        qk = text.get("qk_nope_head_dim", 0) + text.get("qk_rope_head_dim", 0)
        traps.append(
            f"text_config.head_dim {text['head_dim']} is a stale carry-over, ignored: MLA heads are "
            f"qk_nope_head_dim + qk_rope_head_dim = {qk} wide, values v_head_dim {text.get('v_head_dim')}"
        )
    if "rope_theta" in text or "rope_parameters" in text:
        traps.append(
            "text_config.rope_theta / rope_parameters are ignored: K3's MLA uses no rotary embedding (NoPE)"
        )
    vocab = text.get("vocab_size")
    if isinstance(vocab, int):
        first_special = vocab - NUM_SPECIAL_IDS
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = text.get(key, raw.get(key))
            if isinstance(value, int) and value < first_special:
                traps.append(
                    f"{key} {value} in config.json is an ordinary token (specials start at {first_special}): "
                    "the tokenizer's special id is used, as the reference's tokenizer does"
                )
        past = sorted(i for i in (added_tokens or {}).values() if isinstance(i, int) and i >= vocab)
        if past:
            traps.append(
                f"added_tokens.json: {len(past)} tokens ({past[0]}..{past[-1]}) lie past vocab_size {vocab}: "
                "no embedding row, so the model never produces them"
            )
    floats = {dtype for dtype, _ in (headers or {}).values() if dtype in _FLOATS}
    if floats == {"F32"}:
        traps.append(
            "every floating tensor is F32 (the release stores BF16): read as stored; pass dtype= to convert"
        )
    if "quantization_config" in raw and "quantization_config" not in text:
        traps.append(
            "quantization_config sits at the top level (the release has it in text_config): read from there"
        )
    return traps


def special_id(config_id: Any, tokenizer_id: int, vocab_size: int) -> int:
    """The id to use for a special token: the config's where it names a special (the release's eos
    163586 = <|end_of_msg|>, the stop token), else the tokenizer's (the 0.40B's eos 2 is ordinary)."""
    if isinstance(config_id, int) and vocab_size - NUM_SPECIAL_IDS <= config_id < vocab_size:
        return config_id
    return tokenizer_id


def warn_traps(traps: list[str], where: str) -> None:
    """One warning line per trap (logging's last-resort handler prints the message alone on stderr)."""
    for trap in traps:
        log.warning("%s: %s", where, trap)
