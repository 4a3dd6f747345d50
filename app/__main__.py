"""``python -m app``: see ``app.cli``."""

from app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
