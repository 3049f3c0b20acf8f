"""Hydra plugin: the Optuna study sweeper of adls-lightning (``study_sweeper``; logic in ``_impl``)."""
