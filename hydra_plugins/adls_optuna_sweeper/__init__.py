"""Hydra plugin: the Optuna study sweeper of adls-lightning (logic in ``adls_lightning.search.sweeper``)."""
