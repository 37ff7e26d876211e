"""Kimi Delta Attention (KDA) ops: the per-token reference, the chunked form, the decode step, the gates.

Layouts follow fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [N, H, K, V] fp32.
Every attention function returns ``(o [B, T, H, V], final_state or None)``.

Modules: ``naive`` (the specification, a loop over tokens), ``chunk`` (chunkwise WY form, the fast
path), ``state_passing`` (its inter-chunk loop, with a hand-written backward), ``fused`` (the same
chunked form in two native calls, forward and backward), ``native`` + ``_native.cpp`` (the optional
C++ kernels, built by ``python -m k3.ops.build``), ``recurrent`` (decode step), ``gate`` (K3's
bounded gate, Kimi Linear's softplus gate), ``layout`` (token <-> chunk layout, packed sequences),
``inputs`` (shape checks, L2 norm).
"""

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.gate import kda_gate, kda_softplus_gate
from k3.ops.kda.naive import naive_recurrent_kda
from k3.ops.kda.recurrent import recurrent_kda_step

__all__ = ["chunk_kda", "kda_gate", "kda_softplus_gate", "naive_recurrent_kda", "recurrent_kda_step"]
