"""The operators of a transformer prefill, with the work each does on one GPU.

A layer is the sequence a serving stack launches (the operator names are Vidur's, whose
profiles time them): the attention block (``input_layernorm``, ``attn_pre_proj`` (QKV),
``attn_rope``, ``attn`` (the attention core), ``attn_post_proj`` (O), ``add``), an
all-reduce, the FFN block (``post_attention_layernorm``, ``mlp_up_proj`` (gate and up),
``mlp_act`` (SiLU * up, or GeLU), ``mlp_down_proj``, ``add``) and an all-reduce; a pass
also runs the embedding first and the LM head last.  Tensor parallelism shards the
projections and heads; norms, residual adds and the embedding run whole on every GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

GEMM, MEMORY, ATTENTION = "gemm", "memory", "attention"


@dataclass(frozen=True)
class Operator:
    """One kernel on one GPU: its name, how it is timed and the work it does."""
    name: str
    kind: str                # GEMM | MEMORY | ATTENTION
    flops: float
    bytes: float             # HBM traffic
    tokens: int              # rows it processes (queries for attention)
    gemm: tuple[int, int] = (0, 0)   # (in, out) features of a GEMM, after sharding
    seqs: int = 0            # sequences (attention), for the kernel's grid
    context: int = 0         # keys each sequence's last query sees (attention)
    heads: int = 0           # query heads on this GPU (attention)
    alibi: bool = False      # attention scores biased by ALiBi (BLOOM) rather than rotated keys


def _gemm(name, tokens, i, o, dt):
    return Operator(name, GEMM, 2.0 * tokens * i * o, float(dt * (i * o + tokens * i + tokens * o)), tokens, (i, o))


def _memory(name, tokens, nbytes):
    return Operator(name, MEMORY, 0.0, float(nbytes), tokens)


def keys_seen(start: int, n: int, window: int) -> float:
    """Keys the ``n`` new queries of a sequence after ``start`` earlier tokens attend to, in
    all: causal, the query at position x sees x keys, or the latest ``window`` of them (the
    integral of min(x, window) from start to start + n; n * (start + n/2) without a window)."""
    a, b = start, start + n
    if b <= window:
        return n * (start + n / 2)
    if a >= window:
        return float(n * window)
    return (window * window - a * a) / 2 + window * (b - window)


def attention_block(m, seqs: int, start: int, n: int, tp: int) -> list[Operator]:
    """The attention block of one layer for a pass of ``n`` new tokens per sequence after
    ``start`` earlier ones (a chunked prefill's later passes), on one of ``tp`` GPUs."""
    tokens, h, d, dt = seqs * n, m.hidden, m.head_dim, m.dtype_bytes
    heads, kv = m.heads // tp, max(1, m.kv_heads // tp)
    ops = [_memory("input_layernorm", tokens, 2 * tokens * h * dt),
           _gemm("attn_pre_proj", tokens, h, (heads + 2 * kv) * d, dt)]
    if m.rope:
        ops.append(_memory("attn_rope", tokens, 2 * tokens * (heads + kv) * d * dt))
    window = m.window or start + n
    flops = 4.0 * seqs * keys_seen(start, n, window) * heads * d
    nbytes = dt * (tokens * 2 * (heads + kv) * d + seqs * min(start, window) * 2 * kv * d)
    ops.append(Operator("attn", ATTENTION, flops, float(nbytes), tokens, seqs=seqs, context=min(start + n, window),
                        heads=heads, alibi=not m.rope))
    ops += [_gemm("attn_post_proj", tokens, heads * d, h, dt), _memory("add", tokens, 3 * tokens * h * dt)]
    return ops


def ffn_block(m, seqs: int, n: int, tp: int) -> list[Operator]:
    """The FFN block of one layer for ``n`` new tokens per sequence, on one of ``tp`` GPUs."""
    tokens, h, f, dt = seqs * n, m.hidden, m.ffn // tp, m.dtype_bytes
    up = 2 * f if m.gated else f
    return [_memory("post_attention_layernorm", tokens, 2 * tokens * h * dt),
            _gemm("mlp_up_proj", tokens, h, up, dt),
            _memory("mlp_act", tokens, (up + f) * tokens * dt),
            _gemm("mlp_down_proj", tokens, f, h, dt),
            _memory("add", tokens, 3 * tokens * h * dt)]


def embedding(m, seqs: int, n: int) -> Operator:
    """The token embedding of a pass: a row gathered and written per token."""
    tokens = seqs * n
    return _memory("emb", tokens, 2 * tokens * m.hidden * m.dtype_bytes)


def lm_head(m, seqs: int, tp: int) -> Operator:
    """The LM head of the last pass: logits of each sequence's last token (vocabulary sharded)."""
    return _gemm("lm_head", seqs, m.hidden, -(-m.vocab // tp), m.dtype_bytes)
