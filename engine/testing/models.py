"""`models()`: a hypothesis strategy of random pure loss functions with their params and batch.

Each drawn `ModelCase` is a small network built from a random list of layers (MLP, residual,
layernorm, attention, skip connections, a second parallel stream, tied weights, batch inputs used
mid-model) ending in a loss that is a mean over the batch, so fnpipe's contract holds:
`grads == torch.func.grad(case.fn)(case.params, *case.batch)` for every split and microbatching.

    from hypothesis import given
    from engine.testing import models

    @given(models(dtypes=(torch.float64,), max_layers=6))
    def test_my_property(case):
        loss = case.fn(case.params, *case.batch)

Everything is deterministic given the draw (tensors come from a `torch.Generator` seeded by a drawn
seed), and `repr(case)` is the architecture, so a failing example reads as a model description.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

__all__ = ["LAYER_KINDS", "Layer", "ModelCase", "ModelSpec", "build", "models"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "relu": torch.relu,
    "relu_": lambda t: t.relu_(),  # in place on a fresh value: tracing must rewrite it out-of-place
    "identity": lambda t: t,
}
LAYER_KINDS = ("linear", "residual", "layernorm", "attention", "save", "skip", "fork", "aux", "merge",
               "shared", "inject")
MAX_SAVED = 3


@attrs.frozen
class Layer:
    """One drawn layer; `str()` is its part of the model description."""

    kind: str
    width: int = 0          # output width (linear, fork) or hidden width (residual)
    act: str = "identity"
    heads: int = 1          # attention heads
    causal: bool = False    # attention mask
    slot: int = 0           # skip: which saved value it reads
    affine: bool = True     # layernorm: learnable weight and bias

    def __str__(self) -> str:
        return {
            "linear": f"linear({self.width},{self.act})", "residual": f"residual({self.width},{self.act})",
            "layernorm": "layernorm" + ("" if self.affine else "(no affine)"),
            "attention": f"attention(heads={self.heads}{',causal' if self.causal else ''})",
            "save": f"save#{self.slot}", "skip": f"skip#{self.slot}", "fork": f"fork({self.width})",
            "aux": f"aux({self.act})", "merge": "merge", "shared": f"shared({self.width})",
            "inject": "inject(z)",
        }[self.kind]


@attrs.frozen
class ModelSpec:
    """The drawn architecture: input kind, layers, head and sizes (plain data, no tensors)."""

    layers: tuple[Layer, ...]
    tokens: bool            # int token input (embedding) instead of float features
    d_in: int               # feature width, or the embedding width for tokens
    vocab: int              # token vocabulary (tokens only)
    embed_op: str           # "embedding" (F.embedding) or "index" (E[tokens], a gather)
    head: str               # "mse" (pooled regression), "cls" (pooled classes), "lm" (per-token, tokens only)
    tied: bool              # lm head reuses the embedding matrix
    outputs: int            # regression outputs or classes
    batch_size: int
    seq: int
    z_width: int            # width of the mid-model batch input `z` (0: none)

    def describe(self, dtype: torch.dtype, seed: int) -> str:
        inp = f"tokens(V={self.vocab})->{self.embed_op}({self.d_in})" if self.tokens else f"x({self.d_in})"
        head = {"mse": f"mse({self.outputs})", "cls": f"cross_entropy({self.outputs} classes)",
                "lm": "lm" + ("(tied to embedding)" if self.tied else "")}[self.head]
        extra = " + aux stream loss" if _aux_alive(self.layers) else ""
        dt = str(dtype).replace("torch.", "")
        return (f"{dt} B={self.batch_size} S={self.seq} seed={seed}: {inp} | "
                f"{' | '.join(map(str, self.layers)) or '(no layers)'} | head={head}{extra}")


@attrs.frozen(repr=False)
class ModelCase:
    """A pure `fn(params, *batch)` returning a scalar mean loss, with params and a batch to run it on."""

    fn: Callable[..., torch.Tensor]
    params: Any
    batch: tuple[torch.Tensor, ...]
    description: str
    dtype: torch.dtype
    spec: ModelSpec | None = None   # the drawn architecture and seed (None for a hand-made case)
    seed: int | None = None

    def __repr__(self) -> str:
        return f"ModelCase({self.description})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # what hypothesis prints for a failing draw
        printer.text(repr(self))


def _aux_alive(layers: Sequence[Layer]) -> bool:
    alive = False
    for layer in layers:
        alive = True if layer.kind == "fork" else False if layer.kind == "merge" else alive
    return alive


# ---------------------------------------------------------------- drawing


def _valid_kinds(kinds: Sequence[str], saved: int, aux: bool, injected: bool) -> list[str]:
    ok = {"skip": saved > 0, "save": saved < MAX_SAVED, "fork": not aux, "aux": aux, "merge": aux,
          "inject": not injected}
    return [k for k in kinds if ok.get(k, True)]


def _draw_layer(draw: Any, kind: str, w: int, widths: Sequence[int], saved: int) -> Layer:
    acts = st.sampled_from(sorted(ACTIVATIONS))
    if kind in ("linear", "residual"):
        return Layer(kind, width=draw(st.sampled_from(widths)), act=draw(acts))
    if kind == "attention":
        heads = draw(st.sampled_from([h for h in (1, 2, 4) if w % h == 0 and w // h >= 2] or [1]))
        return Layer(kind, heads=heads, causal=draw(st.booleans()))
    if kind == "layernorm":
        return Layer(kind, affine=draw(st.booleans()))
    if kind == "skip":
        return Layer(kind, slot=draw(st.integers(0, saved - 1)))
    if kind == "save":
        return Layer(kind, slot=saved)
    if kind == "fork":
        return Layer(kind, width=draw(st.sampled_from(widths)))
    if kind == "aux":
        return Layer(kind, act=draw(acts))
    return Layer(kind, width=w)  # merge, shared, inject


def _draw_layers(draw: Any, n: int, d0: int, widths: Sequence[int], kinds: Sequence[str]) -> tuple[Layer, ...]:
    layers, w, saved, aux, injected = [], d0, 0, False, False
    for _ in range(n):
        valid = _valid_kinds(kinds, saved, aux, injected)
        if not valid:  # e.g. kinds=("skip",) with nothing saved yet
            break
        kind = draw(st.sampled_from(valid))
        layer = _draw_layer(draw, kind, w, widths, saved)
        layers.append(layer)
        w = layer.width if kind == "linear" else w
        saved += kind == "save"
        aux = True if kind == "fork" else False if kind == "merge" else aux
        injected = injected or kind == "inject"
    return tuple(layers)


def models(dtypes: Sequence[torch.dtype] = (torch.float64,), *, min_layers: int = 1, max_layers: int = 6,
           widths: Sequence[int] = (4, 8, 12, 16), batch_sizes: Sequence[int] = (8, 16), max_seq: int = 4,
           kinds: Sequence[str] = LAYER_KINDS) -> st.SearchStrategy[ModelCase]:
    """Random pure loss functions (see the module docstring).

    dtypes: float dtypes to draw from (float64, float32, bfloat16); min_layers/max_layers: how many
    layers; widths: feature widths (4..16 keeps tests fast); batch_sizes: multiples of 8, so any
    microbatch count up to 8 divides them; max_seq: sequence length 1..max_seq; kinds: the layer kinds
    to draw from (LAYER_KINDS; `skip` only after a `save`, `aux`/`merge` only after a `fork`).
    """
    unknown = set(kinds) - set(LAYER_KINDS)
    if unknown:
        raise ValueError(f"unknown layer kinds {sorted(unknown)}; choose from {LAYER_KINDS}")
    bad = [d for d in dtypes if not d.is_floating_point]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be floating point dtypes such as torch.float64, got {list(dtypes)}")
    if min(batch_sizes) < 1 or not 0 <= min_layers <= max_layers:
        raise ValueError(f"need batch sizes >= 1 and 0 <= min_layers <= max_layers, got {batch_sizes}, "
                         f"{min_layers}..{max_layers}")
    return _models(tuple(dtypes), min_layers, max_layers, tuple(widths), tuple(batch_sizes), max_seq, tuple(kinds))


@st.composite
def _models(draw: Any, dtypes: tuple[torch.dtype, ...], min_layers: int, max_layers: int, widths: tuple[int, ...],
            batch_sizes: tuple[int, ...], max_seq: int, kinds: tuple[str, ...]) -> ModelCase:
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    tokens = draw(st.booleans())
    d0 = draw(st.sampled_from(widths))
    layers = _draw_layers(draw, draw(st.integers(min_layers, max_layers)), d0, widths, kinds)
    head = draw(st.sampled_from(("mse", "cls", "lm") if tokens else ("mse", "cls")))
    spec = ModelSpec(
        layers=layers, tokens=tokens, d_in=d0, vocab=draw(st.integers(3, 16)),
        embed_op=draw(st.sampled_from(("embedding", "index"))), head=head,
        tied=head == "lm" and draw(st.booleans()), outputs=draw(st.integers(2, 6)),
        batch_size=draw(st.sampled_from(batch_sizes)), seq=draw(st.integers(1, max_seq)),
        z_width=draw(st.sampled_from(widths)) if any(x.kind == "inject" for x in layers) else 0)
    return build(spec, dtype=dtype, seed=seed)


# ---------------------------------------------------------------- params and batch


class _Init:
    """Seeded tensors: weights scaled by 1/sqrt(fan_in), drawn in float64 then cast (same for every dtype)."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def weight(self, *shape: int, scale: float | None = None) -> torch.Tensor:
        s = 1.0 / math.sqrt(shape[0]) if scale is None else scale
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * s).to(self.dtype)

    def ints(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen)


def _layer_params(layer: Layer, w: int, spec: ModelSpec, widths: dict[str, int], init: _Init) -> dict[str, Any]:
    k = layer.kind
    if k == "linear":
        return {"w": init.weight(w, layer.width), "b": init.weight(layer.width, scale=0.1)}
    if k == "residual":
        return {"w1": init.weight(w, layer.width), "w2": init.weight(layer.width, w)}
    if k == "layernorm":
        return {"w": 1 + init.weight(w, scale=0.1), "b": init.weight(w, scale=0.1)} if layer.affine else {}
    if k == "attention":
        return {n: init.weight(w, w) for n in ("w_q", "w_k", "w_v", "w_o")}
    if k == "skip":
        return {"w": init.weight(widths[f"save{layer.slot}"], w)}
    if k == "fork":
        return {"w": init.weight(w, layer.width)}
    if k in ("aux", "merge"):
        return {"w": init.weight(widths["aux"], widths["aux"] if k == "aux" else w)}
    if k == "inject":
        return {"w": init.weight(spec.z_width, w)}
    return {}  # save, shared (its weight lives in params["shared"])


def _params(spec: ModelSpec, init: _Init) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if spec.tokens:
        params["embed"] = init.weight(spec.vocab, spec.d_in, scale=1.0)
    layers, shared, widths, w = [], {}, {}, spec.d_in
    for layer in spec.layers:
        layers.append(_layer_params(layer, w, spec, widths, init))
        if layer.kind == "shared" and f"w{w}" not in shared:
            shared[f"w{w}"] = init.weight(w, w)
        widths.update({"save": {f"save{layer.slot}": w}, "fork": {"aux": layer.width}}.get(layer.kind, {}))
        w = layer.width if layer.kind == "linear" else w
    params["layers"] = layers
    if shared:
        params["shared"] = shared
    params["head"] = _head_params(spec, w, init)
    if _aux_alive(spec.layers):
        params["aux_head"] = {"w": init.weight(widths["aux"], 2)}
    return params


def _head_params(spec: ModelSpec, w: int, init: _Init) -> dict[str, Any]:
    if spec.head == "lm" and spec.tied:
        return {"proj": init.weight(w, spec.d_in)}  # logits = (h @ proj) @ embed.T
    n = spec.vocab if spec.head == "lm" else spec.outputs
    return {"w": init.weight(w, n), "b": init.weight(n, scale=0.1)}


def _batch(spec: ModelSpec, init: _Init) -> tuple[torch.Tensor, ...]:
    b, s = spec.batch_size, spec.seq
    x = init.ints(spec.vocab, b, s) if spec.tokens else init.weight(b, s, spec.d_in, scale=1.0)
    z = (init.weight(b, s, spec.z_width, scale=1.0),) if spec.z_width else ()
    if spec.head == "mse":
        y = init.weight(b, spec.outputs, scale=1.0)
    else:
        y = init.ints(spec.vocab, b, s) if spec.head == "lm" else init.ints(spec.outputs, b)
    return (x, *z, y)


# ---------------------------------------------------------------- the loss function


class _State:
    """The values flowing through one call: main stream, second stream, saved skips, the z input."""

    def __init__(self, params: Any, h: torch.Tensor, z: torch.Tensor | None) -> None:
        self.params, self.h, self.z = params, h, z
        self.aux: torch.Tensor | None = None
        self.saved: dict[int, torch.Tensor] = {}


def _attention(p: Any, layer: Layer, s: _State) -> None:
    b, n, w = s.h.shape
    heads = lambda t: t.reshape(b, n, layer.heads, w // layer.heads).transpose(1, 2)  # noqa: E731
    q, k, v = (heads(s.h @ p[name]) for name in ("w_q", "w_k", "w_v"))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=layer.causal)
    s.h = s.h + o.transpose(1, 2).reshape(b, n, w) @ p["w_o"]


def _layernorm(p: Any, layer: Layer, s: _State) -> None:
    s.h = F.layer_norm(s.h, (s.h.shape[-1],), p.get("w"), p.get("b"))


def _merge(p: Any, layer: Layer, s: _State) -> None:
    assert s.aux is not None
    s.h, s.aux = s.h * torch.sigmoid(s.aux @ p["w"]), None


def _set(attr: str, f: Callable[[Any, Layer, _State], torch.Tensor]) -> Callable[[Any, Layer, _State], None]:
    return lambda p, layer, s: setattr(s, attr, f(p, layer, s))


APPLY: dict[str, Callable[[Any, Layer, _State], None]] = {
    "linear": _set("h", lambda p, ly, s: ACTIVATIONS[ly.act](s.h @ p["w"] + p["b"])),
    "residual": _set("h", lambda p, ly, s: s.h + ACTIVATIONS[ly.act](s.h @ p["w1"]) @ p["w2"]),
    "layernorm": _layernorm,
    "attention": _attention,
    "save": lambda p, ly, s: s.saved.__setitem__(ly.slot, s.h),
    "skip": _set("h", lambda p, ly, s: s.h + s.saved[ly.slot] @ p["w"]),
    "fork": _set("aux", lambda p, ly, s: torch.tanh(s.h @ p["w"])),
    "aux": _set("aux", lambda p, ly, s: s.aux + ACTIVATIONS[ly.act](s.aux @ p["w"])),
    "merge": _merge,
    "shared": _set("h", lambda p, ly, s: torch.tanh(s.h @ s.params["shared"][f"w{s.h.shape[-1]}"])),
    "inject": _set("h", lambda p, ly, s: s.h + s.z @ p["w"]),
}


def _embed(spec: ModelSpec, params: Any, x: torch.Tensor) -> torch.Tensor:
    if not spec.tokens:
        return x
    return F.embedding(x, params["embed"]) if spec.embed_op == "embedding" else params["embed"][x]


def _loss(spec: ModelSpec, params: Any, s: _State, y: torch.Tensor) -> torch.Tensor:
    p = params["head"]
    if spec.head == "lm":
        logits = (s.h @ p["proj"]) @ params["embed"].t() if spec.tied else s.h @ p["w"] + p["b"]
        loss = F.cross_entropy(logits.reshape(-1, spec.vocab), y.reshape(-1))
    else:
        out = s.h.mean(1) @ p["w"] + p["b"]
        loss = F.mse_loss(out, y) if spec.head == "mse" else F.cross_entropy(out, y)
    if s.aux is not None:  # a second output: mean over the batch of the aux stream's squared head
        loss = loss + 0.1 * (s.aux.mean(1) @ params["aux_head"]["w"]).square().mean()
    return loss


def _run(spec: ModelSpec, params: Any, x: torch.Tensor, z: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    s = _State(params, _embed(spec, params, x), z)
    for layer, p in zip(spec.layers, params["layers"]):
        APPLY[layer.kind](p, layer, s)
    return _loss(spec, params, s, y)


def _loss_fn(spec: ModelSpec) -> Callable[..., torch.Tensor]:
    # Explicit argument names, so traced batch leaves are named x, z, y.
    if spec.z_width:
        def loss_fn(params: Any, x: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _run(spec, params, x, z, y)
    else:
        def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[misc]
            return _run(spec, params, x, None, y)
    return loss_fn


def build(spec: ModelSpec, *, dtype: torch.dtype = torch.float64, seed: int = 0) -> ModelCase:
    """The ModelCase of an architecture: its pure loss function, seeded params and batch."""
    init = _Init(seed, dtype)
    params = _params(spec, init)
    return ModelCase(_loss_fn(spec), params, _batch(spec, init), spec.describe(dtype, seed), dtype, spec, seed)
