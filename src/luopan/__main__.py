"""``python -m luopan``: the ``luopan`` command (luopan.cli.main), for environments without the console script."""

from .cli.main import main

if __name__ == "__main__":
    main()
