"""The layer contract of ``app/`` (``.importlinter``): each layer imports only the layers below it, ``models`` imports
nothing of the service or the client, the client neither, and no two modules of ``app/``, ``models/`` or the client
import each other in a loop (``models.attention`` and ``models.attention_op`` did, through a function-level import).
Run with import-linter's own command, so that what the suite checks is what a developer runs (``lint-imports``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    command = shutil.which("lint-imports")
    assert command is not None, "lint-imports is missing: pip install -e '.[test]' installs import-linter"
    result = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


def test_a_broken_layer_is_caught(tmp_path):
    # The negative control: the same contract over a copy of app/ where the core imports the API must fail.
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "app", copy / "app", ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copytree(ROOT / "models", copy / "models", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "wm_refiner_client", copy / "wm_refiner_client", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", copy / ".importlinter")
    values = copy / "app" / "core" / "values.py"
    values.write_text(values.read_text() + "\nfrom app.api import deps  # noqa: E402\n")
    env = {"PYTHONPATH": str(copy), "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                             "lint_imports_command()", "--no-cache"], cwd=copy, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert "app.core is not allowed to import app.api" in result.stdout
