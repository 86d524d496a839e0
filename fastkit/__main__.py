"""``python -m fastkit``: the same as the ``fastkit`` command."""

from fastkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
