"""wm_refiner_client installs on its own (clients/python) and works without torch: the wheel carries the whole
package and asks for no torch, FastAPI or model code; installed alone, it streams a clip through a live server with
``import torch`` made impossible."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile

from bench.live import ROOT

PACKAGE = ROOT / "wm_refiner_client"

NO_TORCH_RUN = r"""
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
import numpy as np
import wm_refiner_client as wm
assert wm.__file__.startswith(sys.argv[2]), wm.__file__  # the installed copy, not the checkout
with wm.Client(sys.argv[1]) as client:
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((1, 128, 8, 4, 4), dtype=np.float32)
    prompt = rng.standard_normal((1, 6, 32), dtype=np.float32)
    streamed = wm.concat(client.create_session().stream([latents[:, :, :5], latents[:, :, 5:]], prompt=prompt))
    assert np.array_equal(streamed, client.refine(latents, prompt).latents)
    print("ok", streamed.shape, "torch" in sys.modules and sys.modules["torch"] is not None)
"""


def test_the_client_wheel_is_complete_and_needs_no_torch(server, tmp_path):
    # Build from a copy laid out like the checkout, so the build leaves nothing in the working tree.
    (tmp_path / "src" / "clients").mkdir(parents=True)
    shutil.copytree(ROOT / "clients" / "python", tmp_path / "src" / "clients" / "python")
    shutil.copytree(PACKAGE, tmp_path / "src" / "wm_refiner_client", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(tmp_path / "src" / "clients" / "python")],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("wm_refiner_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = email.message_from_string(archive.read(next(n for n in names if n.endswith("METADATA"))).decode())
    sources = {f"wm_refiner_client/{p.relative_to(PACKAGE)}" for p in PACKAGE.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert sources <= names and "wm_refiner_client/py.typed" in names
    requires = [req for req in metadata.get_all("Requires-Dist") if "extra ==" not in req]
    assert sorted(req.split(">")[0].split("<")[0].split("=")[0].strip() for req in requires) == [
        "httpx", "numpy", "safetensors", "websockets"]

    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env["PYTHONPATH"] = str(site)  # not the checkout: its app/ and models/ stay out of reach
    run = subprocess.run([sys.executable, "-c", NO_TORCH_RUN, server.base_url, str(site)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["ok", "(1,", "128,", "8,", "4,", "4)", "False"]


