"""``python -m adls_lightning.graph``: the command :mod:`adls_lightning.tools.graph` (Lab 0 in one command)."""

from adls_lightning.tools.graph import main

if __name__ == "__main__":
    main()
