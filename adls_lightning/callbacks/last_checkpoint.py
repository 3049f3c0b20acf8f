"""``last.ckpt`` that is always the newest state of the fit: every N training steps, and when training ends.

It calls three of ``ModelCheckpoint``'s protected methods (its "nothing new to save" test, its monitor candidates
and its last-checkpoint save), as :mod:`adls_lightning.callbacks.trainer_control` does for the Trainer, checked on the same
Lightning version (``trainer_control.CHECKED_ON_LIGHTNING``); ``tests/test_resume.py`` is what fails when they change.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class LastCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint(save_last=True, every_n_train_steps=N)`` that also writes ``last.ckpt`` when training ends.

    Lightning's own writes ``last.ckpt`` only with another save of the same callback, that is every N steps here; its
    ``on_train_end`` adds one only if none was ever written. So a fit whose step count is not a multiple of N left a
    ``last.ckpt`` up to N - 1 steps old: ``train=false ckpt_path=last`` evaluated older weights than the fit's last
    validation, and a resume to more epochs trained those steps again.
    """

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # Lightning's own test for "nothing new to save": fitting, not sanity checking, and a step not yet saved.
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @property
    @override
    def state_key(self) -> str:
        # Keyed as the plain ModelCheckpoint it replaced, so checkpoints written before it still restore its state.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)
