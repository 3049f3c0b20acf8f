"""The old home of the tools' option parser, now :mod:`adls_lightning.tools.options`: an alias kept for the
commands that still live in the library (``export``, ``export.evaluate``, ``export.predict``, ``adls-budget``) until
they move into :mod:`adls_lightning.tools` (``scripts/import_graph.py`` names them: they alone may import it)."""

from adls_lightning.tools.options import FLAGS as FLAGS
from adls_lightning.tools.options import HELP_FLAGS as HELP_FLAGS
from adls_lightning.tools.options import HelpRequested as HelpRequested
from adls_lightning.tools.options import check_writable as check_writable
from adls_lightning.tools.options import flag_option as flag_option
from adls_lightning.tools.options import run_tool as run_tool
from adls_lightning.tools.options import split_options as split_options
