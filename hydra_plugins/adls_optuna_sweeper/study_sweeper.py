"""The plugin class Hydra discovers. Hydra imports every plugin module at start-up, so this one stays light:
the sweeper (Optuna, the search library) is imported only when a sweep is configured to use it."""

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction


class StudySweeper(Sweeper):
    """Delegates to :class:`adls_lightning.search.sweeper.StudySweeper`; arguments as documented there."""

    def __init__(self, **kwargs: Any) -> None:
        from adls_lightning.search.sweeper import StudySweeper as Impl

        self.sweeper = Impl(**kwargs)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: Any) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.sweeper.sweep(arguments)
