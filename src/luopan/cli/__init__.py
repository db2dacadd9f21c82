"""The ``luopan`` command line (typer + rich)."""
