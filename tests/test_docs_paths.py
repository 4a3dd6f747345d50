"""Every repository path the README and docs/*.md name exists, so a moved or removed file cannot leave a guide
pointing at nothing. Fast (no model, no server): it reads text only.

What counts as a path: a backticked span or a link target that starts with one of the repository's top-level
folders (``app/...``, ``models/...``, ``tests/...``); and, in the README's architecture picture, every file name
on a line, looked up in that line's folder or one above it (``auth.py`` beside ``app/api/factory.py`` is app/api/auth.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
TOP = ("app", "models", "bench", "tests", "docs", "deploy", "configs", "clients", "examples", "wm_refiner_client")

# `app/engine/worker.py`, `tests/gpu/`, `bench/gpu_check.sh [--wheels DIR] OUT` (a command: its first word), and link
# targets [text](docs/api.md#errors) (the anchor dropped).
_TOP = "|".join(TOP)
BACKTICKED = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(rf"^(?:\./)?((?:{_TOP})/[\w./*-]*)")
# In a text block: a path that starts a token (not the tail of a URL or of another path).
IN_PICTURE = re.compile(rf"(?<![\w/.])((?:{_TOP})/[\w./-]*)")
FILE_NAME = re.compile(r"(?<![\w/.])(\w+\.(?:py|md|sh|toml|yaml|yml|json|html))\b")


def named_paths(text: str) -> set[str]:
    """The repository paths a guide names in backticks or links."""
    spans = [m.group(1).split()[0] for m in BACKTICKED.finditer(text) if m.group(1).strip()]
    spans += LINK.findall(text)
    found = set()
    for span in spans:
        match = REPO_PATH.match(span)
        if match:
            found.add(match.group(1).rstrip("."))
    return found


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_guide_names_exists(guide):
    text = guide.read_text()
    paths = named_paths(text)
    missing = sorted(path for path in paths if not exists(path))
    assert not missing, f"{guide.name} names paths that are not in the repository: {missing}"


def picture() -> list[str]:
    """The lines of the README's architecture picture (the text block under "How it fits together")."""
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index("## How it fits together"):]
    block = after[after.index("```text\n") + len("```text\n"):]
    return block[: block.index("```")].splitlines()


def test_the_readme_picture_names_only_files_that_exist():
    missing, seen, folder = [], 0, None
    for line in picture():
        paths = IN_PICTURE.findall(line)
        for path in paths:
            seen += 1
            if not (ROOT / path).exists():
                missing.append(path)
        if paths:  # a line naming a folder starts its part; the indented lines under it continue it
            folder = Path(paths[0]) if paths[0].endswith("/") else Path(paths[0]).parent
        if folder is None:
            continue
        # A bare file name belongs to the part's folder or one above it, up to the top-level one.
        candidates = [folder, *folder.parents][:-1]  # never the repository root
        for name in FILE_NAME.findall(line):
            if any(path.endswith(name) for path in paths):
                continue
            seen += 1
            if not any((ROOT / where / name).is_file() for where in candidates):
                missing.append(f"{name} (looked in {[str(where) for where in candidates]})")
    assert seen > 30, "the picture was not found or no longer names files; update this test with it"
    assert not missing, f"README's architecture picture names files that do not exist: {missing}"


def test_a_missing_path_is_caught():
    """The check itself: a made-up path is found and reported, a real one is not."""
    text = "see `app/no_such_module.py` and [the API](docs/api.md#errors), run `bench/gpu_check.sh --smoke OUT`"
    assert named_paths(text) == {"app/no_such_module.py", "docs/api.md", "bench/gpu_check.sh"}
    assert not exists("app/no_such_module.py") and exists("docs/api.md")
