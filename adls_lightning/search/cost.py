"""A cost model measured on this machine: what each linear layer of a model costs in each runtime choice, and what
a whole assignment of choices costs.

Choices (:data:`CHOICES`), each a module that runs in PyTorch eager on this CPU, so any mix of them is one model
that can be run and timed end to end:

* ``fp32``: the layer as it is (``nn.Linear``, torch's GEMM);
* ``bf16``: the weight cast to bfloat16, the input cast on the way in and the output cast back (:class:`Bf16Linear`);
* ``int8``: torch's dynamic int8 linear (``torch.ao.nn.quantized.dynamic.Linear``: int8 weights per tensor, the
  input quantized per batch), the "torch int8 (dynamic)" row of docs/inference.md. The project's ``int8=scaled``
  export runs in ONNX Runtime, one graph for the whole model; a per-layer mix with bf16 or MXINT8 layers has no
  ONNX Runtime form, so the cost model prices the int8 runtime that mixes: torch's;
* ``mxint8``: the packed MXINT8 layer of ``format=mxint8`` (:class:`~adls_lightning.mxint8.qlinear.QLinearPacked`,
  group 32);
* ``w50``, ``w75``: structured width -- a feed-forward pair (``intermediate.dense`` then ``output.dense``) keeping
  50 % or 75 % of its intermediate neurons, i.e. a smaller dense layer: the up projection with fewer outputs, the
  down projection with fewer inputs (:func:`layer_role`);
* ``identity``: a layer NAS replaced by ``nn.Identity`` (costs nothing).

For each distinct layer shape and choice :func:`measure_layers` times the layer alone at the batch and length asked
(``batch x tokens`` rows, ``threads`` threads): warm-up, then interleaved rounds over the choices of a shape, the
median per choice. At one thread the clock is the thread's CPU time (:func:`clock_for`): on a machine shared with
other work, wall time counts the time the process waited for a core, which says nothing about the layer. The rest of the model (embeddings, attention's matmuls and softmax, LayerNorms, activations) is
one measured remainder: the whole fp32 model's median latency minus the sum of its linear layers' fp32 latencies.
A prediction is ``remainder + sum of the chosen layers' latencies`` (:meth:`CostTable.predict`).

Measurements are cached per machine in ``<cache_dir>/cost_table.json`` (the JSON helpers of
:mod:`adls_lightning.gemm`): an entry's key holds the CPU kind (name, family, model, flags), the torch version, the threads, the
rows and the shape and choice (:func:`machine_key`), so a table measured on one CPU is never read on another.

Bytes are the weights' storage bytes (biases and scales included); BitOPs are ``rows x in x out x weight bits x
activation bits`` of the layer's products.

Library code: no Lightning imports.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.gemm import _read_cache, _write_cache, cpu_kind

CACHE_FILE = "cost_table.json"
CHOICES = ("fp32", "bf16", "int8", "mxint8", "w75", "w50", "identity")
#: the choices any linear layer can take (structured widths only where a feed-forward pair exists)
PRECISION_CHOICES = ("fp32", "bf16", "int8", "mxint8")
WIDTHS = {"w75": 0.75, "w50": 0.5}
MXINT8_GROUP = 32
#: (weight bits, activation bits) of the products each choice computes
BITS = {"fp32": (32, 32), "bf16": (16, 16), "int8": (8, 8), "mxint8": (8, 32), "identity": (0, 0)}
#: a feed-forward pair's up and down projections (BERT ``intermediate.dense`` / ``output.dense`` of one block)
UP_SUFFIX = "intermediate.dense"
DOWN_SUFFIX = "output.dense"
ROUNDS = 7
WARMUP = 2


class Bf16Linear(nn.Module):
    """A linear layer whose weight (and bias) is held in bfloat16: the input is cast to bfloat16, the product runs
    in bfloat16 and the output is cast back to the input's dtype, so it drops into a float32 model."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        bias = linear.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)


@dataclass(frozen=True)
class LayerShape:
    """A linear layer's shape: ``in_features -> out_features``, with or without a bias; ``role``: ``up`` / ``down``
    for a feed-forward pair's projections (where structured widths apply), else ``""``."""

    in_features: int
    out_features: int
    bias: bool = True
    role: str = ""

    @property
    def key(self) -> str:
        return f"{self.in_features}x{self.out_features}{'b' if self.bias else ''}{self.role}"

    def choices(self) -> tuple[str, ...]:
        widths = tuple(WIDTHS) if self.role else ()
        mx = ("mxint8",) if self.in_features % MXINT8_GROUP == 0 else ()
        return ("fp32", "bf16", "int8", *mx, *widths)

    def resized(self, choice: str) -> LayerShape:
        """The dense shape a structured width leaves (the shape itself for the other choices)."""
        ratio = WIDTHS.get(choice)
        if ratio is None or not self.role:
            return self
        if self.role == "up":
            return LayerShape(self.in_features, kept(self.out_features, ratio), self.bias, self.role)
        return LayerShape(kept(self.in_features, ratio), self.out_features, self.bias, self.role)


def kept(size: int, ratio: float) -> int:
    """Neurons a structured width keeps of ``size``: at least one."""
    return max(1, round(size * ratio))


def layer_role(name: str) -> str:
    """``up`` / ``down`` for a feed-forward pair's projections (``...intermediate.dense`` and the same block's
    ``...output.dense`` that is not ``attention.output.dense``), else ``""``."""
    if name.endswith(UP_SUFFIX):
        return "up"
    if name.endswith(DOWN_SUFFIX) and not name.endswith("attention." + DOWN_SUFFIX):
        return "down"
    return ""


def linear_layers(model: nn.Module) -> dict[str, LayerShape]:
    """Every linear layer of ``model`` by module name (``nn.Linear``, and the wrappers that keep one: QuantLinear,
    PEFT's LoRA layer -- counted once, by the wrapper), with its shape and role."""
    layers: dict[str, LayerShape] = {}
    inner: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inner:
            continue
        linear = module if isinstance(module, nn.Linear) else getattr(module, "linear", None)
        if linear is None and hasattr(module, "base_layer") and isinstance(module.base_layer, nn.Linear):
            linear = module.base_layer
        if isinstance(linear, nn.Linear):
            inner.update(id(m) for m in module.modules())
            layers[name] = LayerShape(
                linear.in_features, linear.out_features, linear.bias is not None, layer_role(name)
            )
    return layers


def layer_bytes(shape: LayerShape, choice: str) -> int:
    """Storage bytes of the layer's weight and bias in ``choice`` (scales included)."""
    if choice == "identity":
        return 0
    s = shape.resized(choice)
    elements = s.in_features * s.out_features
    bias = 4 * s.out_features if s.bias else 0
    if choice == "bf16":
        return 2 * elements + (2 * s.out_features if s.bias else 0)
    if choice == "int8":
        return elements + bias + 8  # one scale and zero point per tensor
    if choice == "mxint8":
        return elements + elements // MXINT8_GROUP + bias  # one shared exponent byte per group
    return 4 * elements + bias  # fp32 and the structured widths (dense fp32 layers)


def layer_bitops(shape: LayerShape, choice: str, rows: int) -> float:
    """BitOPs of one forward of the layer over ``rows`` tokens: products x weight bits x activation bits."""
    s = shape.resized(choice)
    weight_bits, act_bits = BITS.get(choice, BITS["fp32"])
    return float(rows) * s.in_features * s.out_features * weight_bits * act_bits


def build_layer(linear: nn.Linear, choice: str, keep: torch.Tensor | None = None) -> nn.Module:
    """``linear`` in ``choice``'s runtime (its weights converted). Structured widths take ``keep``: the intermediate
    neurons kept (rows of an up projection, columns of a down projection); the role says which."""
    linear = linear.eval()
    if choice == "fp32":
        return linear
    if choice == "bf16":
        return Bf16Linear(linear)
    if choice == "int8":
        from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

        float_linear = copy.deepcopy(linear).float()
        float_linear.qconfig = torch.ao.quantization.default_dynamic_qconfig
        with (
            warnings.catch_warnings()
        ):  # torch.ao's deprecation notice: it is still the int8 linear that mixes
            warnings.simplefilter("ignore", UserWarning)
            return DynamicInt8Linear.from_float(float_linear)
    if choice == "mxint8":
        from adls_lightning.mxint8.qlinear import QLinearPacked

        return QLinearPacked.from_linear(linear, group_size=MXINT8_GROUP)
    if choice == "identity":
        return nn.Identity()
    raise ConfigError(f"choice={choice!r}: not a runtime choice (valid: {', '.join(CHOICES)})")


def narrowed(linear: nn.Linear, role: str, keep: torch.Tensor) -> nn.Linear:
    """A smaller dense layer: the up projection's rows ``keep`` (``role='up'``), or the down projection's input
    columns ``keep`` (``role='down'``)."""
    with torch.no_grad():
        if role == "up":
            small = nn.Linear(linear.in_features, len(keep), bias=linear.bias is not None)
            small.weight.copy_(linear.weight[keep])
            if linear.bias is not None:
                small.bias.copy_(linear.bias[keep])
        else:
            small = nn.Linear(len(keep), linear.out_features, bias=linear.bias is not None)
            small.weight.copy_(linear.weight[:, keep])
            if linear.bias is not None:
                small.bias.copy_(linear.bias)
    return small.eval()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the body with ``threads`` intra-op threads, the previous count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def machine_key(threads: int, batch: int, tokens: int) -> str:
    """What a measurement depends on besides the layer: the CPU's kind (:func:`~adls_lightning.gemm.cpu_kind`: its
    name, family, model and a digest of its flags), torch's version, the threads, the rows (batch x tokens) and the
    clock read (:func:`clock_for`)."""
    return "|".join(
        [
            cpu_kind(),
            f"torch={torch.__version__}",
            f"threads={threads}",
            f"b{batch}xt{tokens}",
            f"clock={clock_for(threads)}",
        ]
    )


def clock_for(threads: int) -> str:
    """The clock a measurement at ``threads`` threads reads: ``cpu`` (the calling thread's CPU time) at one thread,
    where torch computes in the calling thread, so time the thread spent waiting for a core taken by other processes
    is not counted (on an idle core the two agree); ``wall`` (``perf_counter``) with more threads, whose work is
    spread over other threads."""
    return "cpu" if threads == 1 else "wall"


def time_calls(
    calls: Mapping[str, Callable[[], object]], rounds: int = ROUNDS
) -> dict[str, dict[str, float]]:
    """Median seconds of each call on both clocks (``{name: {"cpu": s, "wall": s}}``): ``WARMUP`` calls each, then
    ``rounds`` rounds calling each once in turn (interleaved: load from other processes falls on all alike)."""
    for call in calls.values():
        for _ in range(WARMUP):
            call()
    seconds: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "wall": []} for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            wall, cpu = time.perf_counter(), time.thread_time()
            call()
            seconds[name]["cpu"].append(time.thread_time() - cpu)
            seconds[name]["wall"].append(time.perf_counter() - wall)
    return {
        name: {c: statistics.median(values) for c, values in clocks.items()}
        for name, clocks in seconds.items()
    }


def _layer_calls(shape: LayerShape, choices: Iterable[str], batch: int, tokens: int) -> dict[str, Callable]:
    gen = torch.Generator().manual_seed(0)  # a private stream: timing must not move the run's random numbers
    calls = {}
    for choice in choices:
        s = shape.resized(choice)
        linear = nn.Linear(s.in_features, s.out_features, bias=s.bias)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(s.out_features, s.in_features, generator=gen) * 0.05)
        module = build_layer(linear, "fp32" if choice in WIDTHS else choice)
        x = torch.randn(batch, tokens, s.in_features, generator=gen)

        def call(module=module, x=x):
            with torch.inference_mode():
                return module(x)

        calls[choice] = call
    return calls


def measure_layers(
    shapes: Iterable[LayerShape], batch: int, tokens: int, threads: int, rounds: int = ROUNDS
) -> dict[str, dict[str, float]]:
    """Milliseconds of one forward of each shape in each of its choices (median of ``rounds`` interleaved rounds)."""
    table: dict[str, dict[str, float]] = {}
    with torch_threads(threads):
        for shape in shapes:
            seconds = time_calls(_layer_calls(shape, shape.choices(), batch, tokens), rounds)
            table[shape.key] = {choice: 1e3 * s[clock_for(threads)] for choice, s in seconds.items()}
    return table


def model_inputs(model: nn.Module, batch: int, tokens: int) -> dict[str, torch.Tensor]:
    """Random token ids (and a full attention mask) for a sequence classifier."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", 1000)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, tokens), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def model_call(model: nn.Module, batch: int, tokens: int) -> Callable[[], object]:
    inputs = model_inputs(model, batch, tokens)

    def call():
        with torch.inference_mode():
            return model(**inputs)

    return call


def measure_models(
    models: Mapping[str, nn.Module],
    batch: int,
    tokens: int,
    threads: int,
    rounds: int = ROUNDS,
    clock: str | None = None,
) -> dict[str, float]:
    """Median milliseconds of one forward of each model (interleaved rounds) on ``clock`` (default: the one the
    cost table reads at ``threads``, :func:`clock_for`)."""
    with torch_threads(threads):
        seconds = time_calls({name: model_call(m, batch, tokens) for name, m in models.items()}, rounds)
    return {name: 1e3 * s[clock or clock_for(threads)] for name, s in seconds.items()}


def architecture_key(model: nn.Module) -> str:
    """A digest of what the remainder depends on: the model's class, its config and its linear layers' shapes."""
    config = getattr(model, "config", None)
    described = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else ""
    layers = ",".join(f"{n}:{s.key}" for n, s in linear_layers(model).items())
    text = f"{type(model).__name__}|{described}|{layers}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class CostTable:
    """A model's per-layer latencies (ms) per choice, its measured remainder, and the machine and shape asked."""

    layers: dict[str, LayerShape]
    latency_ms: dict[str, dict[str, float]]  # shape key -> choice -> ms
    remainder_ms: float
    fp32_ms: float  # the whole fp32 model as measured
    base_bytes: int  # the model's parameters outside its linear layers (fp32)
    batch: int
    tokens: int
    threads: int
    machine: str
    sources: dict[str, str] = field(default_factory=dict)

    def choices(self, name: str) -> tuple[str, ...]:
        return self.layers[name].choices()

    def layer_ms(self, name: str, choice: str) -> float:
        if choice == "identity":
            return 0.0
        return self.latency_ms[self.layers[name].key][choice]

    def check(self, assignment: Mapping[str, str]) -> None:
        for name, choice in assignment.items():
            if name not in self.layers:
                raise ConfigError(
                    f"{name}: not a linear layer of the model (layers: {', '.join(self.layers)})"
                )
            if choice != "identity" and choice not in self.choices(name):
                raise ConfigError(
                    f"{name}={choice}: not a choice of this layer (valid: {', '.join(self.choices(name))})"
                )

    def predict(self, assignment: Mapping[str, str]) -> float:
        """Predicted ms of the model with ``assignment`` (layer -> choice; absent layers: fp32)."""
        self.check(assignment)
        return self.remainder_ms + sum(self.layer_ms(n, assignment.get(n, "fp32")) for n in self.layers)

    def model_bytes(self, assignment: Mapping[str, str]) -> int:
        self.check(assignment)
        return self.base_bytes + sum(
            layer_bytes(s, assignment.get(n, "fp32")) for n, s in self.layers.items()
        )

    def bitops(self, assignment: Mapping[str, str]) -> float:
        rows = self.batch * self.tokens
        return sum(layer_bitops(s, assignment.get(n, "fp32"), rows) for n, s in self.layers.items())

    @property
    def fp32_predicted_ms(self) -> float:
        return self.predict({})


def _base_bytes(model: nn.Module, layers: Mapping[str, LayerShape]) -> int:
    linear_params = set()
    for name in layers:
        for p in model.get_submodule(name).parameters():
            linear_params.add(id(p))
    return sum(4 * p.numel() for p in model.parameters() if id(p) not in linear_params)


def cost_table(
    model: nn.Module,
    batch: int = 8,
    tokens: int = 128,
    threads: int = 1,
    cache_dir: str | Path | None = None,
    rounds: int = ROUNDS,
    measure_layers_fn: Callable[..., dict[str, dict[str, float]]] | None = None,
    measure_models_fn: Callable[..., dict[str, float]] | None = None,
) -> CostTable:
    """The cost table of ``model`` (an fp32 sequence classifier) at ``batch x tokens`` on ``threads`` threads: each
    distinct shape's choices and the model's remainder from the cache where this machine measured them, measured
    (and cached) otherwise."""
    for key, value in (("batch", batch), ("tokens", tokens), ("threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value}: must be a positive integer")
    layers = linear_layers(model)
    machine = machine_key(threads, batch, tokens)
    cache = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
    entries = _read_cache(cache)
    shapes = {s.key: s for s in layers.values()}
    latency: dict[str, dict[str, float]] = {}
    sources: dict[str, str] = {}
    missing = []
    for key, shape in shapes.items():
        cached = entries.get(f"{machine}|layer|{key}")
        if isinstance(cached, dict) and all(c in cached for c in shape.choices()):
            latency[key] = cached
            sources[key] = "cached"
        else:
            missing.append(shape)
    if missing:
        measured = (measure_layers_fn or measure_layers)(missing, batch, tokens, threads, rounds)
        for shape in missing:
            latency[shape.key] = measured[shape.key]
            entries[f"{machine}|layer|{shape.key}"] = measured[shape.key]
            sources[shape.key] = "measured"
    model_key = f"{machine}|model|{architecture_key(model)}"
    whole = entries.get(model_key)
    if not isinstance(whole, dict) or "fp32_ms" not in whole:
        fp32 = (measure_models_fn or measure_models)({"fp32": model.eval()}, batch, tokens, threads, rounds)
        whole = {"fp32_ms": fp32["fp32"]}
        entries[model_key] = whole
        sources["model"] = "measured"
    else:
        sources["model"] = "cached"
    if cache is not None and "measured" in sources.values():
        _write_cache(cache, entries)
    fp32_ms = float(whole["fp32_ms"])
    linear_fp32 = sum(latency[s.key]["fp32"] for s in layers.values())
    return CostTable(
        layers=layers,
        latency_ms=latency,
        remainder_ms=fp32_ms - linear_fp32,
        fp32_ms=fp32_ms,
        base_bytes=_base_bytes(model, layers),
        batch=batch,
        tokens=tokens,
        threads=threads,
        machine=machine,
        sources=sources,
    )


def ffn_pairs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Feed-forward pairs by block prefix: ``{prefix: (up name, down name)}`` where both layers exist."""
    names = list(names)
    pairs = {}
    for name in names:
        if layer_role(name) == "up":
            prefix = name[: -len(UP_SUFFIX)]
            down = prefix + DOWN_SUFFIX
            if down in names:
                pairs[prefix] = (name, down)
    return pairs


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, module)


def _plain_linear(module: nn.Module) -> nn.Linear:
    if isinstance(module, nn.Linear):
        return module
    inner = getattr(module, "linear", None)
    if isinstance(inner, nn.Linear):
        return inner
    raise ConfigError(f"{type(module).__name__}: not a linear layer the cost model can convert")


def apply_assignment(model: nn.Module, assignment: Mapping[str, str]) -> nn.Module:
    """A copy of ``model`` (fp32) whose layers run in their assigned choices. A structured width must be given to
    both layers of a feed-forward pair; it keeps the intermediate neurons with the largest up-projection row norms
    (weight and bias), the same neurons in both layers."""
    model = copy.deepcopy(model).eval()
    names = list(linear_layers(model))
    pairs = ffn_pairs(names)
    done = set()
    for up, down in pairs.values():
        a, b = assignment.get(up, "fp32"), assignment.get(down, "fp32")
        if (a in WIDTHS or b in WIDTHS) and a != b:
            raise ConfigError(
                f"{up}={a}, {down}={b}: a structured width is one choice of the pair (give both)"
            )
        if a in WIDTHS:
            up_linear = _plain_linear(model.get_submodule(up))
            norms = up_linear.weight.detach().pow(2).sum(1)
            if up_linear.bias is not None:
                norms = norms + up_linear.bias.detach().pow(2)
            keep = torch.topk(norms, kept(up_linear.out_features, WIDTHS[a])).indices.sort().values
            _set_module(model, up, narrowed(up_linear, "up", keep))
            _set_module(model, down, narrowed(_plain_linear(model.get_submodule(down)), "down", keep))
            done.update((up, down))
    for name, choice in assignment.items():
        if name in done or choice == "fp32":
            continue
        if name not in names:
            raise ConfigError(f"{name}: not a linear layer of the model")
        if choice in WIDTHS:
            raise ConfigError(f"{name}={choice}: structured widths apply to feed-forward pairs only")
        _set_module(model, name, build_layer(_plain_linear(model.get_submodule(name)), choice))
    return model


def describe(table: CostTable) -> str:
    """The table as text: one line per shape (its count and ms per choice), then the remainder."""
    counts: dict[str, int] = {}
    for s in table.layers.values():
        counts[s.key] = counts.get(s.key, 0) + 1
    lines = [f"cost table ({table.machine}):"]
    for key, count in counts.items():
        per = ", ".join(f"{c} {ms:.3f}" for c, ms in table.latency_ms[key].items())
        lines.append(f"  {key} x{count}: {per} ms ({table.sources.get(key, '')})")
    lines.append(f"  fp32 model {table.fp32_ms:.2f} ms, remainder {table.remainder_ms:.2f} ms")
    return "\n".join(lines)


def table_json(table: CostTable) -> dict:
    return json.loads(
        json.dumps(
            {
                "machine": table.machine,
                "batch": table.batch,
                "tokens": table.tokens,
                "threads": table.threads,
                "fp32_ms": table.fp32_ms,
                "remainder_ms": table.remainder_ms,
                "latency_ms": table.latency_ms,
            }
        )
    )


def deployed_choice(module: nn.Module) -> str | None:
    """The runtime choice a trained layer deploys as: a fake-quantized layer (QuantLinear) whose weight format has
    a runtime here -- ``integer`` or ``scaled_integer`` of at most 8 bits: ``int8``; ``mxint8``: ``mxint8``; a 16-bit minifloat with
    bfloat16's 8 exponent bits: ``bf16`` -- else None (no runtime: it deploys as fp32, and is counted as
    unpriced). A plain linear: ``fp32``."""
    quantizer = getattr(module, "weight_quantizer", None)
    if quantizer is None:
        return "fp32"
    name = getattr(quantizer, "format_name", "")
    width = getattr(quantizer, "width", None)
    if name in ("integer", "scaled_integer") and width is not None and width <= 8:
        return "int8"
    if name == "mxint8":
        return "mxint8"
    if name.startswith("minifloat") and width == 16 and getattr(quantizer, "exponent_width", None) == 8:
        return "bf16"
    return None


def fp32_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every fake-quantized layer back to the linear it wraps (what the remainder and the
    fp32 layers are measured on)."""
    model = copy.deepcopy(model).eval()
    for name, module in list(model.named_modules()):
        if (
            name
            and isinstance(getattr(module, "linear", None), nn.Linear)
            and hasattr(module, "weight_quantizer")
        ):
            _set_module(model, name, module.linear)
    return model


def model_cost(
    model: nn.Module, batch: int = 8, tokens: int = 128, threads: int = 1, cache_dir: str | Path | None = None
) -> dict[str, float]:
    """A trained model's predicted cost as it deploys (:func:`deployed_choice` per linear layer): ``cost/latency_ms``,
    ``cost/latency_x_fp32``, ``cost/model_bytes``, ``cost/bitops`` and ``cost/unpriced_layers`` (fake-quantized
    layers in a format without a runtime, priced as fp32)."""
    assignment: dict[str, str] = {}
    unpriced = 0
    for name in linear_layers(model):
        choice = deployed_choice(model.get_submodule(name))
        if choice is None:
            unpriced += 1
            choice = "fp32"
        assignment[name] = choice
    table = cost_table(fp32_model(model), batch, tokens, threads, cache_dir)
    for name, choice in list(assignment.items()):
        if choice not in table.choices(name):  # e.g. mxint8 on a width that its groups do not tile
            assignment[name] = "fp32"
            unpriced += 1
    latency = table.predict(assignment)
    return {
        "cost/latency_ms": latency,
        "cost/latency_x_fp32": table.fp32_predicted_ms / latency,
        "cost/model_bytes": float(table.model_bytes(assignment)),
        "cost/bitops": table.bitops(assignment),
        "cost/unpriced_layers": float(unpriced),
    }
