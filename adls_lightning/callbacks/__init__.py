"""Lightning callbacks: thin glue over the ``adls_lightning`` library."""
