"""adls_lightning.search: Optuna search through Hydra (sweeper, spaces, objectives, storage, plots)."""
