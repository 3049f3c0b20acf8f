"""``python -m adls_lightning.export``: the command :mod:`adls_lightning.tools.export` (``adls-export``); the
verbs it calls are :mod:`adls_lightning.export.from_checkpoint`."""

import sys

from adls_lightning.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
