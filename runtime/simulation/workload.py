"""The LLM prefill workload: model shapes and the per-layer operators they imply.

Built-in models (``llama3-8b``, ``llama3-70b``, ``qwen2.5-7b``) come from the
data file with their published configs; ``--model path/config.json`` reads a
Hugging Face config (Llama- or BLOOM-style).  Each layer is the operator
sequence of `operators.py`, with FLOPs and bytes from the shapes, sharded over
tensor parallelism.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from fabric_ext.runtime.machine.errors import InputError
from fabric_ext.runtime.machine.fsutil import read_bounded

from .figures import figures
from .operators import GEMM, Operator, attention_block, ffn_block


class WorkloadError(InputError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    dtype_bytes: int = 2
    gated: bool = True       # gated FFN (SiLU(gate) * up, Llama) or one up projection (GeLU, BLOOM)
    rope: bool = True        # rotary position embedding (Llama) or ALiBi biases (BLOOM)
    window: int = 0          # keys a query attends to at most, the latest (sliding window); 0: all before it

    @property
    def shape(self) -> tuple:
        """The layer's shape as Vidur's profiles name it: hidden, heads, KV heads, FFN, gated."""
        return (self.hidden, self.heads, self.kv_heads, self.ffn, self.gated)


@lru_cache(maxsize=64)
def _weight_bytes(model: ModelConfig, tp: int, operator: str) -> int:
    """One GPU's weights of a layer's attention or FFN block: its projections' (`operators`)."""
    block = attention_block(model, 1, 0, 1, tp) if operator == "attention" else ffn_block(model, 1, 1, tp)
    return sum(op.gemm[0] * op.gemm[1] for op in block if op.kind == GEMM) * model.dtype_bytes


MAX_CONFIG = 1 << 20       # bytes of a Hugging Face config.json
DEFAULT_PROMPT = 8192      # tokens of a workload that gives no prompt


class UnknownModel(WorkloadError):
    """A model name that is neither built in nor a config file; ``suggestion`` is the closest name."""

    def __init__(self, name: str, suggestion: str | None):
        self.suggestion = suggestion
        models = ", ".join(figures()["models"])
        super().__init__(f"unknown model '{name}': built-in models are {models}, or give the path of a "
                         "Hugging Face config.json")


def load_model(name_or_path: str) -> ModelConfig:
    models = figures()["models"]
    if name_or_path in models:
        m = models[name_or_path]
        return ModelConfig(name_or_path, m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["head_dim"],
                           m["ffn"], m["vocab"], m["dtype_bytes"], m.get("gated", True), m.get("rope", True))
    p = Path(name_or_path)
    if not p.is_file():
        import difflib
        close = difflib.get_close_matches(name_or_path, list(models), n=1, cutoff=0.6)
        raise UnknownModel(name_or_path, close[0] if close else None)
    try:
        config = json.loads(read_bounded(p, MAX_CONFIG))
        if not isinstance(config, dict):
            raise ValueError("it is not a JSON object")
        return _from_hf_config(config, _file_name(p))
    except (ValueError, OSError, RecursionError) as e:
        raise WorkloadError(f"{p}: not a usable Hugging Face config: {e}") from None


def _file_name(p: Path) -> str:
    """What names a config file's model when the config does not: its folder for a file called
    ``config.json`` (a Hugging Face snapshot's), else its own name."""
    return p.resolve().parent.name if p.stem == "config" and p.resolve().parent.name else p.stem


#: ``model_type``s whose layers are Llama's as the model times them: a gated FFN, rotary
#: positions, every layer attending alike (to all earlier keys, or to a `sliding_window` of them)
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "granite", "olmo2")
#: keys by which a config declares a mixture of experts (the model times dense FFNs only)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
#: bytes per weight of each ``torch_dtype`` the model times (a config without one: 2)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_SHAPE = (1 << 24) - 1   # the largest layer count, width, head count or vocabulary a config may give


def _from_hf_config(c: dict, stem: str) -> ModelConfig:
    """A Llama-style config (a `LLAMA_STYLE` model_type, or none; num_hidden_layers,
    num_attention_heads, num_key_value_heads, intermediate_size: gated FFN, RoPE) or a BLOOM
    one (model_type bloom; n_layer, n_head: multi-head attention with ALiBi, a 4x FFN with
    GeLU).  ValueError names the key that is missing or out of range, or what of the
    architecture the model does not time (experts, another layer type)."""
    def whole(*keys):       # the first of ``keys`` the config has, a whole number in range
        key = next((k for k in keys if k in c), None)
        if key is None:
            raise ValueError(f"it has no '{keys[0]}'")
        v = c[key]
        if type(v) is not int or not 0 < v <= MAX_SHAPE:
            raise ValueError(f"'{key}' must be a whole number from 1 to {MAX_SHAPE}, not {v!r}")
        return v

    dtype = c.get("torch_dtype") or "bfloat16"
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"'torch_dtype' {dtype!r} is not one the model times ({', '.join(DTYPE_BYTES)})")
    kind = c.get("model_type")
    _check_architecture(c, kind)
    # the config's own name for the model, else its file's, with the architecture it declares
    name = c.get("_name_or_path") or (f"{stem} ({kind})" if kind else stem)
    if not isinstance(name, str):
        raise ValueError(f"'_name_or_path' must be a string, not {name!r}")
    if kind == "bloom":
        hidden, heads = whole("hidden_size", "n_embed"), whole("n_head", "num_attention_heads")
        return ModelConfig(name, whole("n_layer", "num_hidden_layers"), hidden, heads, heads,
                           _divided(hidden, heads), 4 * hidden, whole("vocab_size"), DTYPE_BYTES[dtype],
                           gated=False, rope=False)
    hidden, heads = whole("hidden_size"), whole("num_attention_heads")
    return ModelConfig(name, whole("num_hidden_layers"), hidden, heads,
                       whole("num_key_value_heads") if "num_key_value_heads" in c else heads,
                       whole("head_dim") if "head_dim" in c else _divided(hidden, heads),
                       whole("intermediate_size"), whole("vocab_size"), DTYPE_BYTES[dtype],
                       window=_window(c, kind))


def _check_architecture(c: dict, kind) -> None:
    """ValueError for a config whose layers the model would time as another's: experts, or a
    model_type that is neither BLOOM nor Llama-style (a config without one is taken for Llama's)."""
    experts = next((k for k in EXPERT_KEYS if type(c.get(k)) is int and c[k] > 1), None)
    if experts:
        raise ValueError(f"'{experts}' is {c[experts]}: a mixture of experts, and the model times dense "
                         "FFN layers only (it would move one expert's weights and time one expert's work)")
    if kind is not None and kind != "bloom" and kind not in LLAMA_STYLE:
        raise ValueError(f"'model_type' {kind!r} is not one the model times: it times BLOOM and Llama-style "
                         f"layers ({', '.join(LLAMA_STYLE)}: a gated FFN, rotary positions); if this model's "
                         "layers are of that kind, give a copy of the config 'model_type': 'llama'")


def _window(c: dict, kind) -> int:
    """The keys each query attends to (`ModelConfig.window`): the config's `sliding_window`
    where every layer uses it, 0 where none does; ValueError where only some do."""
    window, layered = c.get("sliding_window"), kind in ("qwen2", "qwen3")
    if window is None or not c.get("use_sliding_window", not layered):    # Qwen's default: off
        return 0
    if type(window) is not int or not 0 < window <= MAX_SHAPE:
        raise ValueError(f"'sliding_window' must be a whole number from 1 to {MAX_SHAPE} or null, not {window!r}")
    if layered:
        raise ValueError("'use_sliding_window' windows only the layers from 'max_window_layers' on, and the "
                         "model times every layer's attention alike; set it false in a copy of the config "
                         "to time full attention")
    return window


def _divided(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise ValueError(f"the hidden size {hidden} is no whole number of its {heads} heads")
    return hidden // heads


def tp_problem(model: ModelConfig, tp: int, gpus: list[str]) -> str | None:
    """Why ``tp`` of the fabric's ``gpus`` cannot run ``model`` tensor-parallel (None if they
    can): there are that many, the query heads divide evenly, and the KV heads either divide
    evenly or are replicated evenly."""
    if tp > len(gpus):
        return f"tp {tp} needs {tp} GPUs; the fabric has {len(gpus)} ({', '.join(gpus)})"

    def fits(t):
        return model.heads % t == 0 and (model.kv_heads % t == 0 or t % model.kv_heads == 0)
    if fits(tp):
        return None
    ok = [t for t in range(1, min(model.heads, 256) + 1) if fits(t)]
    return (f"tp {tp} cannot split {model.name} ({model.heads} query heads, {model.kv_heads} KV heads) evenly; "
            f"it splits over {', '.join(map(str, ok))} GPUs")


def _known_name(prop, known, what: str, diags) -> None:
    """An error at ``prop``'s value when it is a string naming none of ``known``."""
    import difflib
    name = getattr(prop.value, "value", None) if prop is not None else None
    if isinstance(name, str) and name not in known:
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
        diags.error(prop.value.span, f"unknown {what} '{name}'",
                    f"did you mean '{close[0]}'?" if close else f"{what}s: {', '.join(known)}")


def check_declaration(symbols, diags) -> None:
    """The policy against the figures the runtime knows, at their line:col: a GPU's `model`
    (a GPU profile), the workload's model (with the closest name), its serving `stack`, and a
    tensor-parallel degree that cannot split the model."""
    for d in symbols.devices.values():
        if d.kind == "gpu":
            _known_name(next((p for p in d.props if p.name.name == "model"), None), figures()["gpu"],
                        "GPU profile", diags)
    w = symbols.workload
    if w is None:
        return
    props = {p.name.name: p for p in w.props}
    _known_name(props.get("stack"), figures()["stacks"], "serving stack", diags)
    model_prop = props.get("model")
    name = getattr(model_prop.value, "value", None) if model_prop else "llama3-8b"
    if not isinstance(name, str):
        return
    try:
        model = load_model(name)
    except UnknownModel as e:
        diags.error(model_prop.value.span, f"unknown model '{name}'",
                    f"did you mean '{e.suggestion}'?" if e.suggestion else
                    f"built-in models: {', '.join(figures()['models'])}, or a Hugging Face config.json path")
        return
    except WorkloadError as e:
        diags.error(model_prop.value.span, str(e))
        return
    tp_prop = props.get("tp")
    tp = getattr(tp_prop.value, "value", None) if tp_prop else None
    if isinstance(tp, int) and tp >= 1:
        why = tp_problem(model, tp, [name for name, d in symbols.devices.items() if d.kind == "gpu"])
        if why:
            diags.error(tp_prop.value.span, why)


@dataclass
class Workload:
    model: ModelConfig
    prompt: int
    batch: int = 1
    tp: int = 1
    chunk_tokens: int = 0          # chunked prefill: tokens per pass (0: whole prompt)
    weights: str = "hbm"           # device holding the weights, or "hbm"
    kv: str = "hbm"                # where KV goes, or "hbm"
    kv_export: str | None = None   # DPU/NIC that exports KV to a decode node
    # bytes per chunk of every transfer, layers of weights issued ahead (figures.json "defaults")
    transfer_chunk: int = field(default_factory=lambda: figures()["defaults"]["transfer_chunk"])
    prefetch: int = field(default_factory=lambda: figures()["defaults"]["prefetch"])

    def pass_count(self) -> int:
        """How many prefill passes the prompt takes (`pass_of` each)."""
        step = self.chunk_tokens or self.prompt
        return -(-self.prompt // step)

    def pass_of(self, p: int) -> tuple[int, int]:
        """(first token, token count) of pass ``p``: asked per block, so not the list of them all
        (a prompt of 8,192 passes has half a million blocks)."""
        step = self.chunk_tokens or self.prompt
        return p * step, min(step, self.prompt - p * step)

    def blocks(self, start: int, n: int) -> dict[str, list[Operator]]:
        """The operators of one layer's attention and FFN blocks (on one GPU) for a pass of n
        tokens per prompt after ``start`` earlier ones."""
        m, tp, b = self.model, self.tp, self.batch
        return {"attention": attention_block(m, b, start, n, tp), "ffn": ffn_block(m, b, n, tp)}

    def weight_bytes(self, operator: str) -> int:
        """One GPU's share of a layer's weights for ``operator`` ("attention" or "ffn"): the
        projections TP shards, with K and V whole where there are fewer KV heads than GPUs."""
        return _weight_bytes(self.model, self.tp, operator)

    def kv_bytes(self, n: int) -> int:
        """KV of one layer for n tokens on one GPU: its KV heads' (TP shards them; with fewer
        KV heads than GPUs each GPU keeps one, as the attention block reads it)."""
        m = self.model
        return 2 * n * self.batch * max(1, m.kv_heads // self.tp) * m.head_dim * m.dtype_bytes

    def attended_kv_bytes(self, start: int) -> int:
        """KV of one layer that a pass after ``start`` earlier tokens reads on one GPU: all of
        theirs, or the latest of a sliding window's."""
        return self.kv_bytes(min(start, self.model.window or start))

    def activation_bytes(self, n: int) -> int:
        return n * self.batch * self.model.hidden * self.model.dtype_bytes

    def kept_bytes(self) -> dict[str, dict[str, int]]:
        """What the prefill keeps in memory until it ends, by where ("hbm": on each GPU of the
        TP group, else a device, for the whole group), then by what: every layer's weights,
        and every layer's KV for the whole prompt and batch."""
        m, out = self.model, {}
        weights = (self.weight_bytes("attention") + self.weight_bytes("ffn")) * m.layers
        kv = self.kv_bytes(self.prompt) * m.layers
        for what, where, per_gpu in (("weights", self.weights, weights), ("KV cache", self.kv, kv)):
            if where != "none":
                out.setdefault(where, {})[what] = per_gpu if where == "hbm" else per_gpu * self.tp
        return out


def prefill_flows(gpus: list[str], weights: str, kv: str, kv_export: str | None, passes: int = 1) -> list[tuple]:
    """(class, operator, source, destination) of every kind of transfer a prefill on ``gpus``
    (the tensor-parallel group) in ``passes`` passes makes: weights from where they live to
    each GPU, KV written back and exported, KV read back for attention (a chunked prefill's
    later passes), and the all-reduce ring.  The compiler warns with it about movements no
    transfer matches."""
    def placed(where):
        return where not in ("hbm", "none")
    out = []
    for i, g in enumerate(gpus):
        if placed(weights):
            out += [("weights", op, weights, g) for op in ("attention", "ffn")]
        for where in (kv, kv_export):
            if where and placed(where):
                out.append(("kv", None, g, where))
        if placed(kv) and passes > 1:
            out.append(("kv", "attention", kv, g))
        if len(gpus) > 1:
            out.append(("activations", "collective", g, gpus[(i + 1) % len(gpus)]))
    return [flow for flow in out if flow[2] != flow[3]]     # a GPU keeping data has it in its HBM


def kept_where_it_lands(cls: str, operator: str | None, dst: str, kv: str) -> bool:
    """Whether a transfer's bytes stay where it ends, what a `tier` may move: KV written back
    to the workload's kv memory (not KV read back, exported, nor weights)."""
    return cls == "kv" and not operator and dst == kv
