"""The measured cost of the trained model, reported into metrics.json: the objectives ``search/objective=
acc_latency`` and ``acc_bytes`` read ``cost/latency_ms`` and ``cost/model_bytes`` from it."""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L
from typing_extensions import override

from adls_lightning.search.cost import model_cost


class CostReport(L.Callback):
    """Prices the run's final model with the cost model measured on this machine
    (:func:`adls_lightning.search.cost.model_cost`: per-layer latencies at ``batch x tokens`` on ``threads``
    threads, cached per CPU in ``cache_dir``); each fake-quantized layer is priced in the runtime it deploys as."""

    def __init__(
        self, batch: int = 8, tokens: int = 128, threads: int = 1, cache_dir: str | None = None
    ) -> None:
        self.batch, self.tokens, self.threads, self.cache_dir = batch, tokens, threads, cache_dir
        self._module: L.LightningModule | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._module = pl_module

    def report(self) -> Mapping[str, float]:
        if self._module is None:
            return {}
        model = getattr(self._module, "model", self._module)
        return model_cost(model, self.batch, self.tokens, self.threads, self.cache_dir)
