"""``python -m app``: see ``app.cli.commands``."""

from app.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
