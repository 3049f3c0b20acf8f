"""torch.compile of a model in place, and what it cost, counted by torch's own instrumentation.

:func:`compile_in_place` uses ``nn.Module.compile``: the module object stays the same and only its call is
compiled, so ``state_dict`` keys never gain the ``_orig_mod.`` prefix that ``torch.compile(module)`` wrappers
add. Checkpoints of compiled and eager runs are interchangeable.

:class:`CompileCounters` reads dynamo's process-wide counters (``torch._dynamo.utils.counters``), its cumulative
compile timers and its per-compilation records (``recompile_reason``), as differences from a snapshot, so
several runs in one process (Optuna trials) each report their own numbers.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Annotated, Any

import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils

from adls_lightning.errors import ConfigError
from adls_lightning.typed_settings import check_value

# Modes torch.compile accepts (``torch._inductor.list_mode_options()``); "default" = no mode.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Backends that only work on CUDA tensors.
CUDA_ONLY_BACKENDS = ("cudagraphs",)


def inductor_option_type(name: str) -> Any:
    """The type ``torch._inductor.config`` declares for a setting (its default's type where it declares none)."""
    import torch._inductor.config as inductor_config

    entry = getattr(inductor_config, "_config", {}).get(name)
    declared = getattr(entry, "value_type", None)
    if declared is not None:
        return declared
    default = getattr(inductor_config, name)
    return Any if default is None else type(default)


def check_inductor_options(key: str, options: Any) -> None:
    """Each of ``options`` a setting of ``torch._inductor.config``, its value of the type torch declares for it
    (torch.compile checks only plain types, and only at the first compile: a string where a callable belongs
    reaches the compiler). A YAML integer is taken for a float setting (:meth:`CompileOptions.torch_kwargs`
    converts it).

    Raises:
        ConfigError: ``KEY.NAME=VALUE: must be ...`` naming the first bad option.
    """
    import torch._inductor.config as inductor_config

    if not isinstance(options, Mapping):
        return
    for name, value in options.items():
        if not hasattr(inductor_config, str(name)):
            raise ConfigError(
                f"{key}.{name}: not a setting of torch._inductor.config (e.g. fallback_random, freezing, max_autotune)"
            )
        try:
            check_value(f"{key}.{name}", value, inductor_option_type(str(name)))
        except ConfigError as err:
            raise ConfigError(f"{err} (the type torch._inductor.config declares)") from None


#: ``compile.options``: inductor settings, each checked against torch's own declared type.
InductorOptions = Annotated[Mapping[str, Any], check_inductor_options]


def available_backends() -> list[str]:
    """Every backend name dynamo knows, including the debugging ones (``eager``, ``aot_eager``)."""
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """Arguments of ``torch.compile``, checked.

    Args:
        backend: a name from :func:`available_backends` (``inductor``, ``aot_eager``, ``eager``, ...).
        mode: one of :data:`MODES`; only ``inductor`` takes a mode other than ``default``.
        dynamic: ``None`` (torch's default: static first, a dimension becomes dynamic when it changes),
            ``True`` (dynamic from the start) or ``False`` (one graph per shape).
        fullgraph: fail instead of splitting the model at a graph break.
        options: inductor settings for this compilation (``torch.compile``'s ``options``: names from
            ``torch._inductor.config``, e.g. ``{"fallback_random": True}``); merged with the mode's own. Other
            backends generate no code and ignore them (so ``compile=inductor compile.backend=eager`` works).
        key: config prefix named in error messages.

    Raises:
        ConfigError: unknown backend, mode or inductor setting, a mode on a non-inductor backend, or a
            non-boolean flag.
    """

    backend: str = "inductor"
    mode: str = "default"
    dynamic: bool | None = None
    fullgraph: bool = False
    options: Mapping[str, Any] | None = None
    key: str = "compile"

    def __post_init__(self) -> None:
        backends = available_backends()
        if self.backend not in backends:
            raise ConfigError(f"{self.key}.backend={self.backend!r}: unknown; valid: {', '.join(backends)}")
        if self.mode not in MODES:
            raise ConfigError(f"{self.key}.mode={self.mode!r}: unknown; valid: {', '.join(MODES)}")
        if self.mode != "default" and self.backend != "inductor":
            raise ConfigError(
                f"{self.key}.mode={self.mode!r}: only compile.backend=inductor takes a mode "
                f"(got backend {self.backend!r}); use mode=default"
            )
        if self.dynamic not in (None, True, False):
            raise ConfigError(f"{self.key}.dynamic={self.dynamic!r}: must be true, false or null")
        if not isinstance(self.fullgraph, bool):
            raise ConfigError(f"{self.key}.fullgraph={self.fullgraph!r}: must be true or false")
        if self.options is not None and not isinstance(self.options, Mapping):
            raise ConfigError(
                f"{self.key}.options={self.options!r}: must be a mapping of inductor settings, e.g. "
                "{fallback_random: true}, or null"
            )
        check_inductor_options(f"{self.key}.options", self.options)
        if self.backend in CUDA_ONLY_BACKENDS and not torch.cuda.is_available():
            raise ConfigError(f"{self.key}.backend={self.backend!r}: needs CUDA, which is not available here")

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` / ``nn.Module.compile``.

        torch.compile takes a mode or options, not both, so with options the mode's own settings are merged
        under them (what torch does with a mode alone).
        """
        kwargs = {"backend": self.backend, "dynamic": self.dynamic, "fullgraph": self.fullgraph}
        mode = None if self.mode == "default" else self.mode
        if self.options and self.backend == "inductor":
            mode_options = torch._inductor.list_mode_options(mode, self.dynamic) if mode else {}
            # torch checks a float setting with isinstance(value, float): a YAML integer becomes its float
            options = {
                name: float(value)
                if inductor_option_type(name) is float and isinstance(value, numbers.Integral)
                else value
                for name, value in self.options.items()
            }
            kwargs["options"] = {**mode_options, **options}
        else:
            kwargs["mode"] = mode
        return kwargs


def compile_in_place(module: torch.nn.Module, options: CompileOptions) -> None:
    """Compile ``module``'s call in place (lazily: dynamo traces at the first forward).

    Submodules swapped later (post-training quantization, MXINT8 packing) fail dynamo's guards on the next call
    and are recompiled, which :class:`CompileCounters` counts as a recompile.
    """
    module.compile(**options.torch_kwargs())


def start_compile_run() -> CompileCounters:
    """Forget what dynamo compiled earlier in this process and count from here.

    Runs in one process (Optuna trials, multirun jobs, tests) compile the same ``forward`` code again and again;
    past ``torch._dynamo.config.recompile_limit`` dynamo silently falls back to eager for it, so a later run
    would be neither compiled nor counted.
    """
    torch._dynamo.reset()
    return CompileCounters()


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``nn.Module.compile`` was called on ``module``."""
    return getattr(module, "_compiled_call_impl", None) is not None


def process_compile_seconds() -> float:
    """Seconds this process has spent compiling with dynamo so far (0 when nothing was compiled)."""
    return dynamo_utils.calculate_time_spent().get("total_wall_time", 0.0)


def _totals() -> dict[str, float]:
    return {
        "seconds": process_compile_seconds(),
        "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
        "graph_breaks": sum(dynamo_utils.counters["graph_break"].values()),
    }


class CompileCounters:
    """Compile time, graphs, graph breaks and recompiles since construction (or :meth:`restart`).

    ``seconds`` is dynamo's ``entire_frame_compile`` + ``entire_backward_compile`` time: tracing, AOTAutograd and
    the backend's code generation, forward and backward. Recompiles come from dynamo's per-compilation records,
    a deque of the last ``torch._dynamo.utils.DEFAULT_COMPILATION_METRICS_LIMIT`` (64) compilations; the count
    is exact while a run compiles fewer frames than that, which the padding policy keeps it to.
    """

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._start = _totals()
        self._start_records = list(dynamo_utils.get_compilation_metrics())

    def report(self, prefix: str = "compile") -> dict[str, float]:
        now = _totals()
        # One record per frame compilation; dynamo fills recompile_reason when the frame had been compiled before.
        # Records present at the snapshot belong to earlier runs.
        seen = {id(r) for r in self._start_records}
        new = [r for r in dynamo_utils.get_compilation_metrics() if id(r) not in seen]
        return {
            f"{prefix}/seconds": now["seconds"] - self._start["seconds"],
            f"{prefix}/graphs": now["graphs"] - self._start["graphs"],
            f"{prefix}/graph_breaks": now["graph_breaks"] - self._start["graph_breaks"],
            f"{prefix}/recompiles": sum(1 for r in new if r.recompile_reason is not None),
        }


def graph_break_reasons() -> dict[str, int]:
    """dynamo's graph-break messages (first line) and how often each occurred in this process."""
    out: dict[str, int] = {}
    for reason, count in dynamo_utils.counters["graph_break"].items():
        line = str(reason).splitlines()[0]
        out[line] = out.get(line, 0) + count
    return out


def is_graph_break_error(error: BaseException) -> bool:
    """Whether ``error`` is dynamo refusing to trace something (what ``fullgraph=True`` turns graph breaks into)."""
    return isinstance(error, torch._dynamo.exc.Unsupported)
