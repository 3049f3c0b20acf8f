"""Report a monitored metric to the trial's Optuna study after every validation and prune bad trials early.

Like optuna-integration's ``PyTorchLightningPruningCallback``, except that the trial object does not come from
an ``objective(trial)`` (the Hydra sweeper never hands it to the job): the callback reopens its trial from the
study's storage by ``(storage, study_name, trial_number)``, which the sweeper puts into the job's config.
"""

from __future__ import annotations

import lightning as L
import optuna
from lightning.pytorch.trainer.states import TrainerFn
from optuna.pruners import NopPruner
from typing_extensions import override

from adls_lightning.data.tasks import DEFAULT_MAIN_METRIC
from adls_lightning.errors import ConfigError
from adls_lightning.search.storage import open_trial


class OptunaPruning(L.Callback):
    """Reports ``monitor`` at each validation during fit (step = 1, 2, ...) and raises ``optuna.TrialPruned``
    when the study's pruner says so (except after the last validation, when stopping saves nothing); the sweeper
    then records the trial as PRUNED.

    Outside a search (``trial_number`` None) it does nothing.

    Args:
        storage: SQLAlchemy URL of the study's storage.
        study_name: the study.
        trial_number: this job's trial.
        monitor: the logged metric to report (e.g. ``val/acc``).
        pruner: an ``optuna.pruners.BasePruner``; None never prunes (values are still recorded).
    """

    def __init__(
        self,
        storage: str | None = None,
        study_name: str | None = None,
        trial_number: int | None = None,
        monitor: str = DEFAULT_MAIN_METRIC,
        pruner: optuna.pruners.BasePruner | None = None,
    ) -> None:
        self.monitor = monitor
        self.trial = None if trial_number is None else open_trial(storage, study_name, trial_number, pruner)
        # Optuna's pruners (and Trial.report) need a single objective
        self.reports = self.trial is not None and len(self.trial.study.directions) == 1
        if self.trial is not None and not self.reports and not isinstance(pruner, (type(None), NopPruner)):
            raise ConfigError(
                f"search.pruner={type(pruner).__name__}: Optuna prunes single-objective studies only; "
                f"study {study_name} has {len(self.trial.study.directions)} objectives (use search/pruner=none)"
            )
        self.validations = 0
        self.epochs = 0.0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validations = 0

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.trial is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise ConfigError(
                f"search.monitor={self.monitor}: not logged (logged: {sorted(trainer.callback_metrics)})"
            )
        self.validations += 1
        # batches trained so far in units of epochs (validation may run inside an epoch)
        batches = trainer.global_step * trainer.accumulate_grad_batches
        self.epochs = batches / trainer.num_training_batches
        self.trial.set_user_attr("train/epochs", self.epochs)
        if not self.reports:
            return
        self.trial.report(float(value), step=self.validations)
        # After the fit's last validation there is nothing left to save: the trial completes with its value.
        last = trainer.max_epochs is not None and trainer.max_epochs > 0 and self.epochs >= trainer.max_epochs
        if not last and self.trial.should_prune():
            raise optuna.TrialPruned(
                f"pruned at validation {self.validations} ({self.monitor}={float(value):.4f}, "
                f"{self.epochs:.2f} epochs)"
            )

    def report(self) -> dict[str, float]:
        """Training epochs and validations of this trial, for metrics.json."""
        return {"search/epochs": self.epochs, "search/validations": float(self.validations)}
