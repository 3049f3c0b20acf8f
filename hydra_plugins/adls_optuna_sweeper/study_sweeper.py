"""The plugin class Hydra discovers. Hydra imports every plugin module at start-up (except ``_``-prefixed ones),
so this one stays light: the sweeper (``_impl``: Optuna, the search library) is imported only when a sweep is
configured to use it."""

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction


class StudySweeper(Sweeper):
    """Delegates to :class:`hydra_plugins.adls_optuna_sweeper._impl.StudySweeper`; arguments as documented there."""

    def __init__(self, **kwargs: Any) -> None:
        from hydra_plugins.adls_optuna_sweeper._impl import StudySweeper as Impl

        self.sweeper = Impl(**kwargs)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: Any) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.sweeper.sweep(arguments)
