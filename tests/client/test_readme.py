"""The README and the guides in docs/, run: their code blocks execute against a live server and do what their
comments say, every block is run here or says why not, the example script passes, and the claims about test
markers hold. Each fix of issue 10's README list has its check here or in test_service_fixes.py."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
import sys
import tomllib

import torch

from bench.live import ROOT
from tests.client.test_cli import cli_env

# The newcomer's README and the guides it sends to; every python/bash block in them is run below or marked
# ``<!-- not run here: why -->``. (docs/benchmarks.md and docs/reliability.md hold benchmark commands, not examples.)
GUIDES = ("README.md", "docs/api.md", "docs/client.md", "docs/operations.md", "docs/cluster.md", "docs/library.md")
DOCS = {name: (ROOT / name).read_text() for name in GUIDES}
README = DOCS["README.md"]
NOT_RUN = re.compile(r"<!-- not run here: \S[^>]*-->\n$")


def section(heading: str, doc: str = "README.md") -> str:
    """A guide's text from ``heading`` to the next heading of the same or a higher level (outside code)."""
    text = DOCS[doc]
    level = len(heading.split(" ", 1)[0])
    lines = text[text.index(heading) :].splitlines(keepends=True)
    taken, fenced = [lines[0]], False
    for line in lines[1:]:
        fenced ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not fenced and 1 <= hashes <= level and line[hashes : hashes + 1] == " ":
            break
        taken.append(line)
    return "".join(taken)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


# What the tests below run: (guide, heading, language). A block of a guide in none of these sections must say why
# it is not run.
RUN = [
    ("README.md", "## A tour in twenty lines", "python"),
    ("docs/library.md", "## Sessions", "python"),
    ("docs/library.md", "## Pixels from the refined latents", "python"),
    ("docs/client.md", "## The client, step by step", "python"),
    ("docs/client.md", "### Writing the input file", "python"),
    ("docs/api.md", "## The raw format (other languages)", "python"),
    ("docs/api.md", "## The raw format (other languages)", "bash"),
    ("docs/api.md", "## Reattach: a dropped stream is not a lost session", "python"),
    ("docs/operations.md", "## Metrics", "bash"),
]


def run_block(code: str, namespace: dict, server=None) -> str:
    """Execute a guide's block (its URLs pointed at ``server``); what it printed."""
    if server is not None:
        code = code.replace("http://127.0.0.1:8000", server.base_url).replace("ws://127.0.0.1:8000", server.ws_url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "guide", "exec"), namespace)
    return out.getvalue()


def run_shell(code: str, server) -> str:
    """A guide's bash block with ``localhost:8000`` pointed at ``server``; its stdout (it must succeed)."""
    code = code.replace("localhost:8000", f"127.0.0.1:{server.port}")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_code_block_of_the_guides_is_run_or_says_why_not():
    run = {(doc, block) for doc, heading, language in RUN
           for block in (python_blocks if language == "python" else bash_blocks)(section(heading, doc))}
    unexplained = []
    for doc, text in DOCS.items():
        for match in re.finditer(r"```(python|bash)\n(.*?)```", text, re.S):
            if (doc, match.group(2)) not in run and not NOT_RUN.search(text[: match.start()]):
                unexplained.append(f"{doc}: {match.group(2).splitlines()[0]}")
    assert not unexplained, f"blocks neither run by a test nor marked <!-- not run here: why -->: {unexplained}"
    for doc, heading, language in RUN:  # a renamed section would silently run nothing
        assert (python_blocks if language == "python" else bash_blocks)(section(heading, doc)), (doc, heading)


def test_the_links_between_the_guides_work():
    broken = []
    for doc, text in {**DOCS, "docs/reliability.md": (ROOT / "docs/reliability.md").read_text()}.items():
        for target in re.findall(r"\]\(([^)#\s]+\.md|[^)#\s]+\.png)(?:#[^)]*)?\)", text):
            if not target.startswith("http") and not ((ROOT / doc).parent / target).is_file():
                broken.append(f"{doc} -> {target}")
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)", text):
            path = (ROOT / doc).parent / target if target else ROOT / doc
            if path.is_file():
                headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
                if anchor not in slugs:
                    broken.append(f"{doc} -> {target}#{anchor}")
    assert not broken, f"links to files or headings that do not exist: {broken}"


def test_no_guide_cites_a_file_that_is_not_in_the_repository():
    """The spec files the service was built from are not shipped; a guide must not send readers to them."""
    for doc, text in DOCS.items():
        assert "shared/spec" not in text, doc
        for path in re.findall(r"`((?:app|models|bench|tests|deploy|configs|examples|docs|wm_refiner_client|clients)"
                               r"/[\w./-]+\.(?:py|md|yaml|yml|sh|cfg|template|png))`", text):
            assert (ROOT / path).exists(), f"{doc} cites {path}, which does not exist"


def test_the_library_snippet_keeps_the_final_short_block(checkpoint_dir):
    """The flush returns the last frames: a snippet that drops them loses the end of the clip."""
    from models import SessionConfig, load_refiner, refine_clip

    code = python_blocks(section("## Sessions", "docs/library.md"))[0].replace("path/to/refiner", str(checkpoint_dir))
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 128, 11, 4, 4, generator=generator)
    embeds = torch.randn(1, 6, 32, generator=generator)
    namespace = dict(latents_chunk=latents, latents=latents, prompt_embeds=embeds, prompt_attention_mask=None)
    printed = run_block(code, namespace)
    assert printed.splitlines()[0].startswith("sink 0 1")
    expected = refine_clip(load_refiner(checkpoint_dir, device="cpu", dtype="float32"), latents, embeds,
                           config=SessionConfig(seed=42, block_size=3, kv_max_frames=11))
    assert namespace["refined"].shape[2] == 11
    assert torch.equal(namespace["refined"], expected) and torch.equal(namespace["clip"], expected)


def test_the_video_snippet_gives_the_reference_pipelines_video(checkpoint_dir, tmp_path):
    """The streamed decode in library.md equals diffusers' SanaWMLTX2Refiner decoding the whole clip (one uint8
    level), frame for frame, with the first sink_frames pixel frames dropped."""
    from models import load_refiner
    from models.checkpoints import build_model, write_vae_checkpoint
    from tests.reference import reference_refine

    vae_dir = write_vae_checkpoint(tmp_path / "vae", preset="tiny-vae")
    library = section("## Sessions", "docs/library.md") + section("## Pixels from the refined latents", "docs/library.md")
    assert "import torch" in library and "RefinerSession, SessionConfig" in library  # the first block's imports
    generator = torch.Generator().manual_seed(1)
    latents, embeds = torch.randn(1, 128, 7, 2, 3, generator=generator), torch.randn(1, 5, 32, generator=generator)
    from models import RefinerSession, SessionConfig

    namespace = dict(torch=torch, RefinerSession=RefinerSession, SessionConfig=SessionConfig, latents=latents,
                     prompt_embeds=embeds, refiner=load_refiner(checkpoint_dir, device="cpu", dtype="float32"))
    code = python_blocks(section("## Pixels from the refined latents", "docs/library.md"))[0]
    run_block(code.replace("path/to/vae", str(vae_dir)), namespace)
    expected = reference_refine(build_model("tiny"), latents, embeds, vae=namespace["decoder"].vae)  # (F, 3, H, W)
    expected = (expected * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    frames = namespace["frames"]
    assert frames.dtype == torch.uint8 and frames.shape == (1, 8 * (7 - 1) + 1 - 1, 64, 96, 3) == (1, *expected.shape)
    assert (frames[0].int() - expected.int()).abs().max().item() <= 1


def spans(printed: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in line.split()[:2]) for line in printed.splitlines() if re.match(r"^\d+ \d+ ", line)]


def test_the_readme_tour_runs_with_the_client(server):
    code = "\n".join(python_blocks(section("## A tour in twenty lines")))
    assert len(code.strip().splitlines()) <= 22, "the README's tour is short"
    assert spans(run_block(code, {}, server)) == [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]


def test_the_client_guide_runs_with_the_client(server):
    code = "\n".join(python_blocks(section("## The client, step by step", "docs/client.md")))
    printed = run_block(code, {}, server)
    assert spans(printed) == [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]  # the sink, blocks of 3, the short last one


def test_the_wire_format_snippets_print_what_their_comments_say(server):
    raw = section("## The raw format (other languages)", "docs/api.md")
    blocks = python_blocks(raw)
    namespace: dict = {}
    printed = [run_block(code, namespace, server) for code in blocks]
    assert printed[0].split()[:4] == ["torch.Size([1,", "128,", "4,", "4,"] and printed[0].split()[-1] == "4"
    # The print and the comment after it: latency_ms (any positive figure), then the other metadata, exactly.
    latency, _, rest = printed[1].strip().partition(" ")
    promised = blocks[1].split("#", 1)[1].strip().partition(" ")
    assert float(latency) > 0 and float(promised[0]) > 0
    assert ast.literal_eval(rest) == ast.literal_eval(promised[2]) == {"frame_start": "0", "frame_end": "4", "seq": "0"}
    streamed = printed[2].splitlines()
    frames = [int(re.search(r"Size\(\[1, 128, (\d+),", line).group(1)) for line in streamed if line.startswith("unit")]
    assert "the last short one" in blocks[2] and frames == [1, 3, 3, 3, 1]
    assert streamed[-1] == '{"type": "done", "frames": 11}' and '{"type": "done", "frames": 11}' in blocks[2]
    assert "max_size=None" in blocks[2] and "1009" in raw


def test_the_curl_session_example_creates_what_its_comment_shows(server):
    (block,) = bash_blocks(section("## The raw format (other languages)", "docs/api.md"))
    created = json.loads(run_shell(block, server))
    shown = block.split("# ", 1)[1]  # {"session_id":"3f0c...","config":{"seed":42,...,"block_size":3,...}}
    assert shown.startswith('{"session_id":') and '"seed":42' in shown and '"block_size":3' in shown
    assert set(created) == {"session_id", "config"}
    assert {k: created["config"][k] for k in ("seed", "fps", "sink_frames", "block_size", "kv_max_frames")} == {
        "seed": 42, "fps": 16.0, "sink_frames": 1, "block_size": 3, "kv_max_frames": 11}


def test_the_reattach_example_resumes_and_gets_every_frame_once(server):
    code = python_blocks(section("## Reattach: a dropped stream is not a lost session", "docs/api.md"))[0]
    namespace: dict = {}
    printed = run_block(code, namespace, server).splitlines()
    assert printed == ["5 4", '{"type": "done", "frames": 11}', "11"], printed
    assert "# 5 4" in code and '# {"type": "done", "frames": 11}' in code and "# 11:" in code
    refined = torch.cat(namespace["received"], dim=2)
    from safetensors.torch import load, save
    import httpx

    whole = httpx.post(f"{server.base_url}/v1/refine", content=save({"latents": namespace["clip"],
                       "prompt_embeds": namespace["prompt"]}), headers={"Content-Type": "application/octet-stream"},
                       timeout=60)
    assert whole.status_code == 200 and torch.equal(refined, load(whole.content)["latents"])  # as if never dropped


def test_the_metrics_table_lists_every_metric_and_the_command_shows_them(server):
    from app.core.metrics import Metrics

    metrics = section("## Metrics", "docs/operations.md")
    documented = set(re.findall(r"`(refiner_\w+?)(?:\{[\w,]+\})?`", metrics))
    registered = {metric.name + ("_total" if metric.type == "counter" else "") for metric in Metrics().registry.collect()}
    assert registered <= documented, f"operations.md does not list the metrics {sorted(registered - documented)}"
    assert documented <= registered, f"operations.md lists metrics that do not exist: {sorted(documented - registered)}"
    (block,) = bash_blocks(metrics)
    lines = run_shell(block, server).splitlines()
    assert lines and all(line.startswith("refiner_") for line in lines)
    assert any(line.startswith("refiner_active_sessions ") for line in lines)


def test_the_example_script_passes_against_a_live_server(server):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--server", server.base_url],
                            cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical on all three paths: True" in result.stdout
    assert "stream: [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]" in result.stdout


def collected(*runs: tuple[str, ...]) -> list[tuple[int, int]]:
    """(tests selected, tests deselected) of ``pytest --collect-only`` with each run's arguments (in parallel)."""
    processes = [
        subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in runs
    ]
    counts = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        match = re.search(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?", out)
        assert match, out[-2000:] + err[-2000:]
        counts.append((int(match.group(1)), int(match.group(3) or 0)))
    return counts


def test_every_marker_selects_tests_and_the_default_run_leaves_out_only_gpu():
    """`-m gpu` selects the CUDA checks (skipped without CUDA), which the default run deselects; `-m slow` selects the
    inner loop's exclusions (tests/conftest.py), which the default run (the README's test command, CI) keeps, and
    `-m "not slow"` runs the rest. A marker the guides mention but no test carries would select nothing and fail."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = sorted(line.split(":", 1)[0] for line in options["markers"])
    assert registered == ["gpu", "slow"]
    mentioned = {marker for text in DOCS.values()
                 for marker in re.findall(r"pytest (?:-q )?-m [\"']?(?:not )?(\w+)", text)}
    assert mentioned <= set(registered), f"the guides mention markers that do not exist: {mentioned - set(registered)}"
    assert "slow" in mentioned, "the README names the inner loop's command"
    assert "not gpu" in options["addopts"] and "slow" not in options["addopts"]
    gpu, slow, fast, default = collected(("-m", "gpu"), ("-m", "slow and not gpu"), ("-m", "not slow and not gpu"), ())
    assert gpu[0] >= 1 and slow[0] >= 1 and fast[0] >= 1
    assert default[1] == gpu[0], "the default run leaves out the gpu tests, and only them"
    assert default[0] == slow[0] + fast[0], "the default run keeps the slow tests"


def test_the_set_up_commands_pin_the_cpu_torch_and_ci_runs_the_test_command():
    # The README keeps two set-up commands for a fresh CPU machine; both take the `cpu` extra, which pins the CPU
    # build of torch (without it pip takes the newest torch, a CUDA build of GBs), while the base requirement admits
    # the CUDA torch a GPU machine brings (>= 2.11), so that `pip install -e .` there keeps it. CI runs the second.
    from packaging.requirements import Requirement

    blocks = bash_blocks(section("## Set-up (fresh machine"))
    commands = [block.strip() for block in blocks]
    assert commands == ["python -m pip install -e '.[cpu]' && python -m app serve",
                        "python -m pip install -e '.[cpu,test]' && python -m pytest -q"], commands
    assert commands[1] in (ROOT / ".ci/run").read_text().replace("pip install -q ", "pip install ")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_base = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    torch_cpu = [Requirement(r) for r in project["optional-dependencies"]["cpu"]]
    assert len(torch_base) == 1 and [r.name for r in torch_cpu] == ["torch"]
    for gpu_torch in ("2.11.0", "2.11.0+cu130", "2.13.0"):
        assert torch_base[0].specifier.contains(gpu_torch), gpu_torch
    # An installed torch is checked as pip checks it (pre-releases allowed): NVIDIA's containers label their build of
    # a release as its pre-release (2.11.0a0+<commit>), which `>=2.11` refuses, so pip would try to replace it.
    for installed in ("2.11.0a0+4c2b6a9.nv26.10", "2.12.0rc1", "2.11.0+cu130"):
        assert torch_base[0].specifier.contains(installed, prereleases=True), installed
    assert not torch_base[0].specifier.contains("2.10.0", prereleases=True)
    assert str(torch_cpu[0].specifier) == "==2.13.0" and torch_cpu[0].specifier.contains("2.13.0+cpu")
