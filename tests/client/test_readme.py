"""The README, run: its code blocks execute against a live server and do what their comments say, the example script
passes, and its claims about test markers hold. Each fix of issue 10's README list has its check here or in
test_service_fixes.py."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import subprocess
import sys
import tomllib

import torch

from bench.live import ROOT
from tests.client.test_cli import cli_env

README = (ROOT / "README.md").read_text()


def section(heading: str) -> str:
    """The README's text from ``heading`` to the next heading of the same or a higher level (outside code)."""
    level = len(heading.split(" ", 1)[0])
    lines = README[README.index(heading) :].splitlines(keepends=True)
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


def run_block(code: str, namespace: dict, server=None) -> str:
    """Execute a README block (its URLs pointed at ``server``); what it printed."""
    if server is not None:
        code = code.replace("http://127.0.0.1:8000", server.base_url).replace("ws://127.0.0.1:8000", server.ws_url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace)
    return out.getvalue()


def test_the_library_snippet_keeps_the_final_short_block(checkpoint_dir):
    """The flush returns the last frames: a snippet that drops them loses the end of the clip."""
    from models import SessionConfig, load_refiner, refine_clip

    code = python_blocks(section("## The refiner as a library"))[0].replace("path/to/refiner", str(checkpoint_dir))
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


def test_the_tour_runs_with_the_client(server):
    code = "\n".join(python_blocks(section("### Five-minute tour")))
    printed = run_block(code, {}, server)
    spans = [tuple(int(n) for n in line.split()[:2]) for line in printed.splitlines() if re.match(r"^\d+ \d+ ", line)]
    assert spans == [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]  # the sink, blocks of 3, the short last one


def test_the_wire_format_snippets_print_what_their_comments_say(server):
    blocks = python_blocks(section("### The wire format (other languages)"))
    namespace: dict = {}
    printed = [run_block(code, namespace, server) for code in blocks]
    assert printed[0].split()[:4] == ["torch.Size([1,", "128,", "4,", "4,"] and printed[0].split()[-1] == "4"
    promised = ast.literal_eval(blocks[1].split("#", 1)[1].strip())  # the comment after the print
    assert ast.literal_eval(printed[1].strip()) == promised == {"frame_start": "0", "frame_end": "4", "seq": "0"}
    streamed = printed[2].splitlines()
    frames = [int(re.search(r"Size\(\[1, 128, (\d+),", line).group(1)) for line in streamed if line.startswith("unit")]
    assert "the last short one" in blocks[2] and frames == [1, 3, 3, 3, 1]
    assert streamed[-1] == '{"type": "done", "frames": 11}' and '{"type": "done", "frames": 11}' in blocks[2]
    assert "max_size=None" in blocks[2] and "1009" in section("### The wire format (other languages)")


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


def test_every_marker_selects_tests_that_the_default_run_leaves_out():
    """`-m gpu` selects the CUDA checks (skipped without CUDA) and the default run deselects them; a marker the
    README or pyproject mentions but no test carries (the old `-m slow`) would select nothing and fail here."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = sorted(line.split(":", 1)[0] for line in options["markers"])
    mentioned = set(re.findall(r"pytest -m (\w+)", README))
    assert mentioned <= set(registered), f"the README mentions markers that do not exist: {mentioned - set(registered)}"
    assert f"not {' and not '.join(registered)}" in options["addopts"]
    *by_marker, default = collected(*[("-m", marker) for marker in registered], ())
    for marker, (selected, _) in zip(registered, by_marker):
        assert selected >= 1, f"-m {marker} selects no test"
    assert default[1] == sum(selected for selected, _ in by_marker)  # the default run leaves exactly them out
