"""torch.compile as a Lightning callback (the ``compile=`` config group)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import lightning as L
from typing_extensions import override

from adls_lightning.compile import (
    CompileCounters,
    CompileOptions,
    InductorOptions,
    compile_in_place,
    graph_break_reasons,
    is_compiled,
    is_graph_break_error,
    start_compile_run,
)
from adls_lightning.errors import ConfigError

log = logging.getLogger(__name__)


class CompileCallback(L.Callback):
    """Compiles ``pl_module.<module>`` in place (:func:`adls_lightning.compile.compile_in_place`).

    Placed after the quantization, pruning and compression callbacks, its ``setup`` runs after theirs, so the
    graph dynamo traces at the first forward is the compressed model. A model replaced later (LoRA merged
    mid-fit) is compiled again at the next train/validation/test start; layers swapped inside it (post-training
    quantization, MXINT8 packing) fail dynamo's guards and are recompiled, and counted as recompiles.
    ``nn.Module.compile`` keeps ``state_dict`` keys, so checkpoints load into eager runs and back.

    :meth:`report` returns ``compile/seconds``, ``compile/graphs``, ``compile/graph_breaks`` and
    ``compile/recompiles`` of this run (:class:`adls_lightning.compile.CompileCounters`).

    Args:
        backend, mode, dynamic, fullgraph, options: see :class:`adls_lightning.compile.CompileOptions`.
        module: dotted path of the submodule to compile, from the LightningModule (``model`` = the backbone,
            with its LoRA adapters and classifier head; ``""`` = the whole LightningModule).

    Raises:
        ConfigError: bad options (here), a missing ``module`` (at setup), or, with ``fullgraph=true``, a model
            that dynamo cannot capture in one graph (at its first forward).
    """

    def __init__(
        self,
        backend: str = "inductor",
        mode: str = "default",
        dynamic: bool | None = None,
        fullgraph: bool = False,
        options: InductorOptions | None = None,
        module: str = "model",
    ) -> None:
        # each setting's type is checked in the pre-flight against these annotations (adls_lightning.typed_settings);
        # options given false are none, as null
        options = None if options is False else options
        self.options = CompileOptions(
            backend=backend,
            mode=mode,
            dynamic=dynamic,
            fullgraph=fullgraph,
            options=dict(options) if isinstance(options, Mapping) else options,
        )
        self.module = module
        self.counters: CompileCounters | None = None

    def _target(self, pl_module: L.LightningModule):
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError:
            names = [n for n, _ in pl_module.named_children()]
            raise ConfigError(
                f"compile.module={self.module!r}: {type(pl_module).__name__} has no such submodule "
                f"(its children: {', '.join(names)}; '' = the whole module)"
            ) from None

    def _ensure_compiled(self, pl_module: L.LightningModule) -> None:
        target = self._target(pl_module)
        if is_compiled(target):
            return
        if self.counters is None:
            self.counters = start_compile_run()
        compile_in_place(target, self.options)
        log.info(
            "Compiling %s (%s) with %s", self.module or "the module", type(target).__name__, self.options
        )

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._ensure_compiled(pl_module)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ensure_compiled(pl_module)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ensure_compiled(pl_module)

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ensure_compiled(pl_module)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self.options.fullgraph and is_graph_break_error(exception):
            reason = str(exception).strip().splitlines()[0]
            raise ConfigError(
                f"compile.fullgraph=true: {self.module or 'the module'} does not compile to one graph ({reason}); "
                "valid: compile.fullgraph=false (split at graph breaks)"
            ) from None

    def report(self) -> dict[str, float]:
        """This run's compile time, graphs, graph breaks and recompiles (empty before anything compiled)."""
        if self.counters is None:
            return {}
        out = self.counters.report()
        for reason, count in graph_break_reasons().items():
            log.info("graph break x%d: %s", count, reason)
        return out
