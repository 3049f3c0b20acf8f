"""The three things the callbacks do to a running ``Trainer`` that Lightning offers no public call for.

Each reaches one step past Lightning's public API, so they live here, in one place, with why each is needed:
when Lightning changes (checked on Lightning 2.6.6; written against 2.x, whose loop layout ``fit_loop.epoch_loop.
val_loop`` and ``fit_loop.max_epochs`` it relies on), this module is what to re-check, and the callback tests
(``tests/test_prune_callback.py``, ``tests/test_quant_callback.py``) are what fails.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

# The Lightning version these calls were last checked against.
CHECKED_ON_LIGHTNING = "2.6.6"


def validate_mid_fit(trainer: L.Trainer) -> None:
    """Runs the fit's validation loop now (as Lightning does at a validation check), updating ``callback_metrics``.

    Used from ``on_train_epoch_end`` to measure the model right after it changed, inside the same fit.
    """
    # No public way: trainer.validate() starts a run of its own (it resets the trainer's state and calls setup
    # again), so it cannot be nested inside trainer.fit, and no hook or flag asks for an extra validation now.
    # This is the call Lightning's own training epoch loop makes at a validation check (Lightning 2.x).
    trainer.validating = True
    trainer.fit_loop.epoch_loop.val_loop.run()
    trainer.training = True


def set_max_epochs(trainer: L.Trainer, epochs: int) -> int:
    """Sets the fit's epoch count from a callback's ``setup``; returns the count it replaced.

    No public way: ``Trainer.max_epochs`` is read-only, and asking users to keep ``trainer.max_epochs`` equal to a
    callback's own epochs by hand would make one number two settings. ``fit_loop.max_epochs`` is the attribute the
    Trainer's constructor fills; ``setup`` runs before the fit loop reads it or the LR schedule is built.
    """
    previous = trainer.fit_loop.max_epochs
    trainer.fit_loop.max_epochs = epochs
    return previous


def forget_best_checkpoints(trainer: L.Trainer) -> None:
    """Makes every metric-monitoring ``ModelCheckpoint`` forget its best-so-far.

    Called when the model changes mid-fit (pruning or compression after some epochs): checkpoints from before hold a
    different model, with a different ``state_dict`` layout, and must not be selected as "best" afterwards. The
    files stay on disk.
    """
    for checkpoint in trainer.checkpoint_callbacks:
        if not isinstance(checkpoint, ModelCheckpoint) or checkpoint.monitor is None:
            continue
        # Through the callback's public state API (what a resumed fit restores), set to a fresh checkpoint's values:
        # ModelCheckpoint has no public reset.
        state = checkpoint.state_dict()
        state.update(
            best_model_score=None,
            best_model_path="",
            kth_best_model_path="",
            best_k_models={},
            kth_value=torch.tensor(torch.inf if checkpoint.mode == "min" else -torch.inf),
        )
        checkpoint.load_state_dict(state)
