"""The `ffctl` command line: one module per command group, each a few lines over the library."""
