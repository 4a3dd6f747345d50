"""The command line on top of the client: ``python -m app stream`` end to end (its progress bar in a pseudo-terminal,
none when piped, its own resume across a server restart, the decoded video), ``sessions``, and ``refine``'s
progress."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pexpect
import pytest
from safetensors.numpy import load_file, save_file

from bench.live import ROOT, ServerProcess, ThreadServer, free_port
import wm_refiner_client as wm
from wm_refiner_client import Client

from .conftest import clip

LATENTS, PROMPT, MASK = clip(24)
TIMEOUT_S = 120


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WM_REFINER_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def write_clip(path: Path, latents=LATENTS, prompt=PROMPT, mask=MASK) -> Path:
    save_file({"latents": latents, "prompt_embeds": prompt, "prompt_attention_mask": mask}, str(path))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI with stdout and stderr piped (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_stream_piped_writes_the_clip_and_no_progress(server, tmp_path):
    source = write_clip(tmp_path / "in.safetensors")
    result = run_cli("stream", "--server", server.base_url, "--input", str(source), "--output",
                     str(tmp_path / "out.safetensors"), "--chunk-frames", "5")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    assert re.search(r"refined 24 frames in \d+ units -> .*out\.safetensors \(session \w+, 0 reconnects\)", result.stdout)
    with Client(server.base_url) as client:
        expected = client.refine(LATENTS, PROMPT, MASK).latents
    assert np.array_equal(load_file(str(tmp_path / "out.safetensors"))["latents"], expected)


def test_stream_in_a_terminal_shows_progress_and_resumes_after_a_restart(checkpoint_dir, tmp_path):
    port = free_port()
    settings = dict(model=str(checkpoint_dir), device="cpu", dtype="float32")

    def server() -> ServerProcess:
        return ServerProcess(port, tmp_path / "cache", tmp_path / "snapshots", tmp_path / "server.log", **settings)

    first = server().start()
    servers = [first]
    try:
        with Client(first.base_url) as client:
            expected = client.refine(LATENTS, PROMPT, MASK).latents
        source = write_clip(tmp_path / "in.safetensors")
        output = tmp_path / "out.safetensors"
        child = pexpect.spawn(
            sys.executable,
            ["-m", "app", "stream", "--server", first.base_url, "--input", str(source), "--output", str(output),
             "--chunk-frames", "2", "--rate", "8"],  # 3 s of sending: the restart lands mid-stream
            cwd=str(ROOT), env=cli_env(), encoding="utf-8", timeout=TIMEOUT_S, dimensions=(24, 200),
        )
        try:
            # The bar: frames refined of the clip, then frames sent, blocks per second, latency, reconnects.
            while True:
                child.expect(r"refined:\s+\d+%.*?\| *(\d+)/24 .*?sent=(\d+) blocks/s=[\d.]+ latency=\d+ms reconnects=0")
                if int(child.match.group(1)) >= 4:
                    break
            assert int(child.match.group(2)) < 24, "the clip was sent before the restart could land mid-stream"
            first.terminate()  # drain: the session is saved, the stream closed with 1012
            servers.append(server().start())
            child.expect(r"reconnects=1")  # the bar says it resumed
            child.expect(r"refined 24 frames in \d+ units .*\(session \w+, (\d+) reconnects\)")
            reconnects = int(child.match.group(1))
            child.expect(pexpect.EOF)
        finally:
            child.close()
        assert child.exitstatus == 0, child.before
        assert reconnects >= 1
        assert np.array_equal(load_file(str(output))["latents"], expected)
    finally:
        for process in servers:
            process.kill()


def test_stream_writes_the_decoded_video(make_settings, tmp_path):
    import av

    from models.checkpoints import write_vae_checkpoint

    vae = write_vae_checkpoint(tmp_path / "vae", preset="tiny-vae")
    latents, prompt, mask = clip(6)
    with ThreadServer(make_settings(vae=str(vae), warmup=False)) as live:
        source = write_clip(tmp_path / "in.safetensors", latents, prompt, mask)
        result = run_cli("stream", "--server", live.base_url, "--input", str(source), "--output",
                         str(tmp_path / "out.safetensors"), "--video", str(tmp_path / "out.mp4"))
        assert result.returncode == 0, result.stderr
        with Client(live.base_url) as client:
            expected = client.refine(latents, prompt, mask, outputs=["video"]).video  # (B, F, H_px, W_px, 3)
    frames = 8 * (6 - 1) + 1 - 1  # F = 8 (T - 1) + 1 - S
    assert expected.shape[1] == frames
    assert f"{frames} video frames -> " in result.stdout
    with av.open(str(tmp_path / "out.mp4")) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(decoded) == frames
    assert decoded[0].shape == expected.shape[2:]
    # H.264 is lossy (and a random VAE's frames are noise to it), but each frame is still closest to the server's
    # frame of the same index: the right frames, in order.
    errors = np.array([[np.abs(d.astype(np.int16) - e.astype(np.int16)).mean() for e in expected[0]] for d in decoded])
    assert list(errors.argmin(axis=1)) == list(range(frames))


def test_sessions_lists_and_deletes(server):
    with Client(server.base_url) as client:
        session = client.create_session()
        session.send(LATENTS[:, :, :5], PROMPT, MASK)
    listed = run_cli("sessions", "--server", server.base_url)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["session", "state", "created", "frames", "in", "frames", "out", "flushed", "streaming",
                              "watchers", "replica"]
    row = next(line for line in rows if line.startswith(session.id))
    assert row.split()[1] == "active" and row.split()[3:8] == ["5", "4", "no", "no", "0"]
    assert row.split()[8] == session.replica
    as_json = run_cli("sessions", "--server", server.base_url, "--json")
    assert session.id in as_json.stdout
    deleted = run_cli("sessions", "--server", server.base_url, "--delete", session.id)
    assert deleted.returncode == 0 and f"deleted {session.id}" in deleted.stdout
    gone = run_cli("sessions", "--server", server.base_url, "--delete", session.id)
    assert gone.returncode == 2 and f"error: {session.id}: 404 session_not_found" in gone.stderr
    # Each id of a list is deleted, whatever became of the ones before it.
    with Client(server.base_url) as client:
        other = client.create_session()
    several = run_cli("sessions", "--server", server.base_url, "--delete", session.id, other.id)
    assert several.returncode == 2 and f"deleted {other.id}" in several.stdout, several
    assert f"error: {session.id}: 404" in several.stderr
    # An id no session can have (a typo, a truncated paste) is one of them too: said, and the rest still deleted (it
    # ended the command with "error (ValueError): ...; choose one such id", the ids after it untried).
    with Client(server.base_url) as client:
        last = client.create_session()
    mistyped = run_cli("sessions", "--server", server.base_url, "--delete", "abc", last.id)
    assert mistyped.returncode == 2 and f"deleted {last.id}" in mistyped.stdout, mistyped
    assert mistyped.stderr.startswith("error: 'abc' is no session id (8 to 64 of A-Z, a-z, 0-9, '_' and '-'"), mistyped


def _watchers(server, session_id: str, count: int) -> None:
    import time

    deadline = time.monotonic() + TIMEOUT_S
    with Client(server.base_url) as client:
        while client.get_session(session_id).state().raw.get("watchers") != count:
            assert time.monotonic() < deadline, f"no {count} watchers on {session_id}"
            time.sleep(0.05)


def test_watch_prints_each_block_and_writes_the_latents_it_saw(server, tmp_path):
    """``python -m app watch SESSION --output F``: read-only, from the moment it attached; one line per block; the
    file holds exactly the frames the producer got back from then on (frame_start in its metadata); it ends with
    the session's flush. An unknown id is one line, exit 2; Ctrl-C exits 130 saying what it watched."""
    from safetensors import safe_open

    with Client(server.base_url) as client:
        session = client.create_session()
        before = session.send(LATENTS[:, :, :5], PROMPT, MASK)  # refined before the watch: not in its file
        output = tmp_path / "watched.safetensors"
        child = start_cli("watch", session.id, "--server", server.base_url, "--output", str(output))
        try:
            _watchers(server, session.id, 1)
            after = [session.send(LATENTS[:, :, 5:14]), session.send(LATENTS[:, :, 14:], flush=True)]
            out, err = child.communicate(timeout=TIMEOUT_S)
        finally:
            if child.poll() is None:
                child.kill()
    assert child.returncode == 0, err
    first = before.frame_end
    blocks = re.findall(r"^frames \[(\d+), (\d+)\) latency \d+ ms$", out, re.M)
    assert blocks and int(blocks[0][0]) == first and int(blocks[-1][1]) == 24, out
    assert f"session {session.id} is flushed: watched {len(blocks)} blocks, frames [{first}, 24) -> {output}" in out
    expected = np.concatenate([unit.latents for unit in after], axis=2)
    assert np.array_equal(load_file(str(output))["latents"], expected)
    with safe_open(str(output), "np") as opened:
        assert opened.metadata()["wm_refiner.frame_start"] == str(first)

    missing = run_cli("watch", "no-such-session", "--server", server.base_url)
    assert missing.returncode == 2 and "404 session_not_found" in missing.stderr, missing

    import signal

    with Client(server.base_url) as client:
        idle = client.create_session()
    child = start_cli("watch", idle.id, "--server", server.base_url)
    try:
        _watchers(server, idle.id, 1)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130 and "interrupted: watched 0 blocks, no frames" in err, (out, err)


def test_without_a_command_the_cli_says_what_it_runs_and_tells_its_version():
    bare = run_cli()
    assert bare.returncode == 2 and "{refine,make-checkpoint,serve,stream,sessions,watch,plan}" in bare.stderr
    assert "serve               run the HTTP/WebSocket service" in bare.stderr
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"wm-refiner {wm.__version__}"


def test_refine_shows_progress_only_in_a_terminal(checkpoint_dir, tmp_path):
    import torch

    from models import SessionConfig, load_refiner, refine_clip

    source = write_clip(tmp_path / "in.safetensors")
    expected = refine_clip(load_refiner(checkpoint_dir, device="cpu", dtype="float32"), torch.from_numpy(LATENTS),
                           torch.from_numpy(PROMPT), torch.from_numpy(MASK), SessionConfig()).numpy()
    args = ["refine", "--model", str(checkpoint_dir), "--input", str(source)]
    piped = run_cli(*args, "--output", str(tmp_path / "piped.safetensors"))
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    child = pexpect.spawn(sys.executable, ["-m", "app", *args, "--output", str(tmp_path / "tty.safetensors")],
                          cwd=str(ROOT), env=cli_env(), encoding="utf-8", timeout=TIMEOUT_S, dimensions=(24, 160))
    child.expect(r"refined: 100%\|.*\| 24/24")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    for name in ("piped", "tty"):
        assert np.array_equal(load_file(str(tmp_path / f"{name}.safetensors"))["latents"], expected)


@pytest.mark.parametrize("flag", ["--chunk-frames=0"])
def test_stream_refuses_bad_arguments_with_one_line(server, tmp_path, flag):
    result = run_cli("stream", "--server", server.base_url, "--input", str(write_clip(tmp_path / "in.safetensors")),
                     "--output", str(tmp_path / "out.safetensors"), flag)
    assert result.returncode == 2 and result.stderr.startswith("error") and len(result.stderr.splitlines()) == 1




def _default_sigint() -> None:
    """In the child before it runs: SIGINT as a terminal delivers it. A suite started in the background by a
    non-interactive shell (``cmd &``) inherits SIGINT ignored, and Python then never turns it into
    KeyboardInterrupt: the CLI would ignore the test's Ctrl-C and run to its end."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app", *args], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)


def interrupt_mid_stream(server, session_id: str, args: list[str], after_frames: int) -> tuple[int, str, str]:
    """``python -m app stream ARGS`` (paced, with ``--session-id``) SIGINTed once the session has returned
    ``after_frames`` frames: the exit status, stdout, stderr."""
    import signal
    import time

    child = start_cli(*args)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        with Client(server.base_url) as client:
            while time.monotonic() < deadline:
                assert child.poll() is None, child.communicate()
                try:
                    if client.get_session(session_id).frames_returned >= after_frames:
                        break
                except Exception:  # not created yet
                    pass
                time.sleep(0.05)
        time.sleep(1.0)  # the CLI reads what the server sent (it may still lag: it writes what it has read)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out, err


def test_ctrl_c_writes_what_was_received_and_a_rerun_continues_to_the_whole_clip(server, tmp_path):
    """Issue 16 item 10. Ctrl-C mid-stream: one line (no traceback), exit 130, and a valid output file holding
    exactly the frames received. Rerunning the same command continues the session (the input it has is not sent
    again) and the file ends bit-identical to an uninterrupted run's; a third run finds it complete, and with the
    file gone, says which frames it can no longer get."""
    from safetensors import safe_open

    source = write_clip(tmp_path / "in.safetensors")
    output = tmp_path / "out.safetensors"
    args = ["stream", "--server", server.base_url, "--input", str(source), "--output", str(output),
            "--chunk-frames", "2", "--session-id", "interrupted-run-1"]
    with Client(server.base_url) as client:
        expected = client.refine(LATENTS, PROMPT, MASK).latents
    code, out, err = interrupt_mid_stream(server, "interrupted-run-1", [*args, "--rate", "6"], after_frames=7)
    assert code == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    match = re.fullmatch(r"interrupted: wrote refined frames \[0, (\d+)\) of 24 to \S+out\.safetensors; run the same "
                         r"command within 60 s \(the server's ws_reattach_grace_s\) to continue session "
                         r"interrupted-run-1\n", err)
    assert match, err
    kept = int(match.group(1))
    with safe_open(str(output), framework="np") as file:
        partial = file.get_tensor("latents")
        assert file.metadata()["wm_refiner.complete"] == "false"
    assert 1 <= kept < 24 and partial.shape[2] == kept
    assert np.array_equal(partial, expected[:, :, :kept])
    with Client(server.base_url) as client:
        received = client.get_session("interrupted-run-1").state().frames_received
    assert received < 24, "the clip was all sent before the interrupt: nothing left to continue"

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert re.search(r"refined 24 frames in \d+ units -> .*\(session interrupted-run-1, 0 reconnects\)", again.stdout)
    assert np.array_equal(load_file(str(output))["latents"], expected)
    with Client(server.base_url) as client:
        assert client.get_session("interrupted-run-1").state().frames_received == 24  # nothing was sent twice

    done = run_cli(*args)
    assert done.returncode == 0 and "is complete" in done.stdout, done.stderr
    # The server dropped the units this client confirmed it had: without the file, say so rather than write less.
    output.unlink()
    lost = run_cli(*args)
    assert lost.returncode == 2 and len(lost.stderr.splitlines()) == 1, lost.stderr
    assert "lacks refined frames from 0" in lost.stderr and "--session-id" in lost.stderr


def test_a_stream_that_fails_mid_way_keeps_the_frames_received(server, tmp_path):
    """The session is deleted under a running ``stream``: the error is the last line (exit 2), and the frames that
    came back before it are in the output file, with a line saying so."""
    import time

    source = write_clip(tmp_path / "in.safetensors")
    output = tmp_path / "out.safetensors"
    child = start_cli("stream", "--server", server.base_url, "--input", str(source), "--output", str(output),
                      "--chunk-frames", "2", "--session-id", "deleted-mid-run", "--rate", "6")
    try:
        with Client(server.base_url) as client:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                assert child.poll() is None, child.communicate()
                try:
                    if client.get_session("deleted-mid-run").frames_returned >= 4:
                        break
                except Exception:  # not created yet
                    pass
                time.sleep(0.05)
            time.sleep(1.0)
            client.delete_session("deleted-mid-run")
            expected = client.refine(LATENTS, PROMPT, MASK).latents
        _, err = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 2, err
    wrote, error = err.strip().splitlines()[-2:]
    assert error.startswith("error") and "Traceback" not in err, err
    kept = int(re.match(r"wrote refined frames \[0, (\d+)\) of 24 to ", wrote).group(1))
    assert 1 <= kept < 24
    assert np.array_equal(load_file(str(output))["latents"], expected[:, :, :kept])


def test_a_rerun_with_another_config_or_input_is_one_line_saying_what_differs(server, tmp_path):
    source = write_clip(tmp_path / "in.safetensors")
    output = tmp_path / "out.safetensors"
    args = ["stream", "--server", server.base_url, "--output", str(output), "--chunk-frames", "2",
            "--session-id", "interrupted-run-2"]
    code, _, err = interrupt_mid_stream(server, "interrupted-run-2", [*args, "--input", str(source), "--rate", "6"],
                                        after_frames=4)
    assert code == 130, err
    other_config = run_cli(*args, "--input", str(source), "--seed", "7")
    assert other_config.returncode == 2 and len(other_config.stderr.splitlines()) == 1, other_config.stderr
    assert "session_exists" in other_config.stderr and "seed" in other_config.stderr
    other = write_clip(tmp_path / "other.safetensors", latents=LATENTS + 1)
    other_input = run_cli(*args, "--input", str(other))
    assert other_input.returncode == 2 and len(other_input.stderr.splitlines()) == 1, other_input.stderr
    assert "another input" in other_input.stderr and "--session-id" in other_input.stderr
    longer = write_clip(tmp_path / "short.safetensors", latents=LATENTS[:, :, :2].copy())
    too_short = run_cli(*args, "--input", str(longer))
    assert too_short.returncode == 2 and "more than the 2 of" in too_short.stderr, too_short.stderr


def test_the_benchmarks_are_not_a_service_command():
    """``python -m app bench`` was an alias that made the service import its own benchmarks; it now only says where
    they went, and nothing the service installs imports ``bench``."""
    result = run_cli("bench", "load")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "`python -m bench`" in result.stderr and not result.stdout
    importers = []
    for package in ("app", "models", "wm_refiner_client"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(name == "bench" or name.startswith("bench.") for name in names):
                    importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not importers, f"the service imports its benchmarks: {importers}"


def test_a_missing_or_wrong_key_says_how_the_cli_sends_one(make_settings):
    """A 401 from a server with api_key: the server's message, and where the CLI takes the key from."""
    with ThreadServer(make_settings(api_key="k" * 32, warmup=False)) as live:
        refused = run_cli("sessions", "--server", live.base_url)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith("error: 401 unauthorized") and refused.stderr.rstrip().endswith(
            "(the CLI sends it from --api-key KEY or $WM_REFINER_API_KEY)"), refused.stderr
        allowed = run_cli("sessions", "--server", live.base_url, "--api-key", "k" * 32)
        assert allowed.returncode == 0, allowed.stderr


def test_a_clip_file_neither_command_can_read_is_refused_before_anything_is_sent(server, checkpoint_dir, tmp_path):
    """A wrong rank or a misspelt tensor name is one line naming the fix, from ``stream`` and ``refine`` alike, and
    no session is created for it (a misspelt prompt_attention_mask was dropped without a word: the run went on
    unmasked)."""
    cases = {
        "rank4": ({"latents": LATENTS[0], "prompt_embeds": PROMPT}, r"latents in .* must have rank 5 \(B, C, T, H, W\)"),
        "rank1": ({"latents": LATENTS.reshape(-1), "prompt_embeds": PROMPT}, r"must have rank 5 .*got shape \(\d+,\)"),
        "mask-rank": ({"latents": LATENTS, "prompt_embeds": PROMPT, "prompt_attention_mask": MASK[0]},
                      r"prompt_attention_mask in .* must have rank 2 \(B, L\)"),
        "misspelt": ({"latents": LATENTS, "prompt_embeds": PROMPT, "prompt_attention_maks": MASK},
                     r"\['prompt_attention_maks'\] that this command does not read; a clip file holds only"),
    }
    with Client(server.base_url) as client:
        before = {summary.session_id for summary in client.sessions()}
    for name, (tensors, message) in cases.items():
        source = tmp_path / f"{name}.safetensors"
        save_file({key: np.ascontiguousarray(value) for key, value in tensors.items()}, str(source))
        for args in (["stream", "--server", server.base_url], ["refine", "--model", str(checkpoint_dir)]):
            result = run_cli(*args, "--input", str(source), "--output", str(tmp_path / "out.safetensors"))
            assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, (name, args[0], result.stderr)
            assert re.search(message, result.stderr), (name, args[0], result.stderr)
    with Client(server.base_url) as client:
        assert not {summary.session_id for summary in client.sessions()} - before  # (other tests' may end)


def test_a_stream_the_server_refuses_at_once_leaves_no_session_behind(server, tmp_path):
    """The server refuses the first frames (float64 latents: 422): the session this run created took nothing and
    is deleted, rather than holding one of max_sessions places until it expires; the refusal is the line shown."""
    source = write_clip(tmp_path / "f64.safetensors", latents=LATENTS.astype(np.float64))
    with Client(server.base_url) as client:
        before = {summary.session_id for summary in client.sessions()}
    result = run_cli("stream", "--server", server.base_url, "--input", str(source), "--output",
                     str(tmp_path / "out.safetensors"))
    assert result.returncode == 2 and "float64" in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    with Client(server.base_url) as client:
        assert not {summary.session_id for summary in client.sessions()} - before  # (other tests' may end)


def test_a_full_server_s_wait_is_said_on_stderr_then_the_stream_goes_on(make_settings, tmp_path):
    """At max_sessions the server answers 503 too_many_sessions with when its next idle session is released; the
    client waits that long and tries again. The CLI says so on stderr (it sat silent for minutes), then streams."""
    source = write_clip(tmp_path / "in.safetensors")
    with ThreadServer(make_settings(max_sessions=1, session_idle_timeout_s=6.0)) as full:
        with Client(full.base_url) as client:
            client.create_session()  # the one place, idle from now on
        result = run_cli("stream", "--server", full.base_url, "--input", str(source), "--output",
                         str(tmp_path / "out.safetensors"))
    assert result.returncode == 0, result.stderr
    assert re.search(r"^POST /v1/sessions: 503 too_many_sessions .*; try 2 of \d+ in \d", result.stderr, re.MULTILINE), result.stderr
    assert "refined 24 frames" in result.stdout


def test_the_cli_shows_long_waits_and_every_warning_of_the_client_and_nothing_else(capsys):
    """show_retries: a retry or reconnection line waiting a second or more, and any warning or error of the client
    (its WebSocket library's too: with a handler of its own the logger no longer falls back to Python's last-resort
    one), are printed; short waits and other INFO lines are not."""
    import logging

    from app.cli import remote

    logger = logging.getLogger("wm_refiner_client")
    before = list(logger.handlers), logger.level
    try:
        remote.show_retries()
        remote.show_retries()  # once only
        logger.info("a short wait", extra={"wait_s": 0.25})
        logger.info("a long wait", extra={"wait_s": 4.0})
        logger.info("some other line")
        logging.getLogger("wm_refiner_client.websocket").warning("the socket said something")
        logging.getLogger("wm_refiner_client.websocket").info("a frame", extra={"wait_s": 9.0})
        logger.error("an error of its own")
    finally:
        logger.handlers[:] = before[0]
        logger.setLevel(before[1])
    assert capsys.readouterr().err.splitlines() == ["a long wait", "the socket said something", "an error of its own"]


def test_refine_without_a_model_uses_the_embedded_tiny_refiner_serve_uses(tmp_path):
    """`refine` took no default model while `serve` did (a new user's trip): without --model it builds (or reuses)
    the embedded tiny refiner under cache_dir, the one `serve` serves, and refines with it."""
    import torch

    from app.runtime.services import ensure_embedded_model
    from models import SessionConfig, load_refiner, refine_clip

    cache = tmp_path / "cache"
    source = write_clip(tmp_path / "in.safetensors")
    result = subprocess.run([sys.executable, "-m", "app", "refine", "--input", str(source), "--output",
                             str(tmp_path / "out.safetensors")], cwd=ROOT, capture_output=True, text=True,
                            env={**cli_env(), "WM_REFINER_CACHE_DIR": str(cache)}, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert f"(the embedded tiny refiner at {cache / 'tiny'}; --model DIR for another)" in result.stdout  # where
    refiner = load_refiner(ensure_embedded_model(cache / "tiny"), device="cpu", dtype="float32")
    expected = refine_clip(refiner, torch.from_numpy(LATENTS), torch.from_numpy(PROMPT), torch.from_numpy(MASK),
                           SessionConfig()).numpy()
    assert np.array_equal(load_file(str(tmp_path / "out.safetensors"))["latents"], expected)


def test_stream_writes_float32_from_a_server_that_answers_in_bfloat16(make_settings, tmp_path):
    """configs/sana-wm.yaml serves `response_dtype: model` (bfloat16, which numpy lacks): `stream` still writes the
    clip, as float32 holding exactly the server's bfloat16 values (it stopped with "cannot be read as numpy")."""
    latents, prompt, mask = clip(7)
    with ThreadServer(make_settings(dtype="bfloat16", response_dtype="model", warmup=False)) as live:
        source = write_clip(tmp_path / "in.safetensors", latents, prompt, mask)
        result = run_cli("stream", "--server", live.base_url, "--input", str(source), "--output",
                         str(tmp_path / "out.safetensors"))
        assert result.returncode == 0, result.stderr
        with Client(live.base_url, return_tensors="pt") as client:
            expected = client.refine(latents, prompt, mask).latents
    assert str(expected.dtype) == "torch.bfloat16"
    written = load_file(str(tmp_path / "out.safetensors"))["latents"]
    assert written.dtype == np.float32
    assert np.array_equal(written, expected.float().numpy())


def test_sessions_behind_peers_names_each_replica_and_says_which_gave_no_listing(make_settings):
    """A deployment's listing (`peers`): the table has each session's replica, and a replica that gave no listing
    (`unreachable`) is said on stderr, not silently left out of a shorter list."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with ThreadServer(make_settings(peers=dead, replica_id="replica-listed", warmup=False)) as live:
        with Client(live.base_url) as client:
            session = client.create_session()
        listed = run_cli("sessions", "--server", live.base_url)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[-1] == "replica"
    row = next(line for line in rows if line.startswith(session.id))
    assert row.split()[-1] == "replica-listed"
    assert listed.stderr.count("\n") == 1 and f"no listing from {dead}" in listed.stderr, listed.stderr


def test_watch_waits_out_a_restart_whose_warm_up_refuses_the_watch(checkpoint_dir, tmp_path):
    """``watch`` across a drain and a restart of the session's server: the new server adopts the session during its
    warm-up, so the session's GET answers but the watch's handshake is refused with 503 not_ready until /ready. The
    watch waits for it, like a stream (it ended with exit 2 and that 503), and ends with the session's flush."""
    import time

    port = free_port()
    settings = dict(model=str(checkpoint_dir), device="cpu", dtype="float32", batching=False)
    latents, prompt, mask = clip(13)

    def server(**warmup) -> ServerProcess:
        return ServerProcess(port, tmp_path / "cache", tmp_path / "snapshots", tmp_path / "server.log",
                             **settings, **warmup)

    servers = [server().start()]
    watcher = None
    try:
        with Client(servers[0].base_url) as client:
            expected = client.refine(latents, prompt, mask).latents
            session = client.create_session()
            session.send(latents[:, :, :4], prompt=prompt, prompt_mask=mask)
            watcher = subprocess.Popen(
                [sys.executable, "-m", "app", "watch", session.id, "--server", servers[0].base_url, "--output",
                 str(tmp_path / "watched.safetensors")],
                cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

            def attached() -> None:
                while session.state().raw["watchers"] == 0:
                    assert watcher.poll() is None, watcher.communicate()
                    time.sleep(0.2)

            attached()  # before the drain closes it with 1012
            servers[0].terminate()
            # A warm-up of seconds: the watch comes back during it.
            servers.append(server(warmup_height=32, warmup_width=64).start())
            attached()  # again, on the restarted server
            session.send(latents[:, :, 4:])
            session.flush()
        out, err = watcher.communicate(timeout=TIMEOUT_S)
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        for process in servers:
            process.kill()
    assert re.search(r'"WebSocket /v1/sessions/\w+/watch[^"]*" 503', servers[1].log()), servers[1].log()
    assert watcher.returncode == 0, err
    assert "restarting (close 1012)" in err
    assert f"session {session.id} is flushed" in out
    watched = load_file(str(tmp_path / "watched.safetensors"))["latents"]
    assert np.array_equal(watched, expected[:, :, 13 - watched.shape[2]:])


@pytest.mark.parametrize(("producer_kind", "kept"), [("stream", 32), ("http", 32), ("http", 1)])
def test_watch_resumes_across_a_restart_without_losing_the_blocks_refined_while_it_was_away(checkpoint_dir, tmp_path,
                                                                                           producer_kind, kept):
    """``watch`` holds the sink and the first block when the session's server drains; while it is away (stopped, so
    that it surely is) the producer resumes on the restarted server and refines the rest of the clip. The watch
    reconnects with resume_from = the frames it holds and gets those blocks from the units the session kept (saved
    by the drain): it exits 0 with the whole clip, where it named a gap (exit 2) before; with a producer over HTTP
    too, whose responses' units are kept as a stream's are. When the server keeps fewer units than were refined
    meanwhile (ws_resume_units=1), the resume is refused and the gap named (exit 2), the file holding the frames
    before it."""
    import json
    import signal
    import threading
    import time

    from safetensors.numpy import save
    from websockets.sync.client import connect

    port = free_port()
    settings = dict(model=str(checkpoint_dir), device="cpu", dtype="float32", batching=False, ws_resume_units=kept)
    latents, prompt, mask = clip(13)

    def server() -> ServerProcess:
        return ServerProcess(port, tmp_path / "cache", tmp_path / "snapshots", tmp_path / "server.log", **settings)

    def stream(base_url: str, session_id: str, query: str = ""):
        url = base_url.replace("http://", "ws://") + f"/v1/sessions/{session_id}/stream{query}"
        return connect(url, open_timeout=TIMEOUT_S, max_size=None)

    def units(ws, count: int) -> None:
        while count:
            count -= isinstance(ws.recv(timeout=TIMEOUT_S), bytes)

    servers = [server().start()]
    watcher = None
    lines: list[str] = []
    client = Client(servers[0].base_url)  # the same URL for both servers
    try:
        expected = client.refine(latents, prompt, mask).latents
        session = client.create_session()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "app", "watch", session.id, "--server", servers[0].base_url, "--output",
             str(tmp_path / "watched.safetensors")],
            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: lines.extend(watcher.stdout), daemon=True)
        reader.start()
        while session.state().raw["watchers"] == 0:
            assert watcher.poll() is None, watcher.stderr.read()
        if producer_kind == "stream":
            with stream(servers[0].base_url, session.id) as producer:
                producer.send(save({"latents": latents[:, :, :4].copy(), "prompt_embeds": prompt,
                                    "prompt_attention_mask": mask}))
                units(producer, 2)  # [0, 1) and [1, 4)
        else:
            session.send(latents[:, :, :4], prompt=prompt, prompt_mask=mask)
        deadline = time.monotonic() + TIMEOUT_S
        while not any("frames [1, 4)" in line for line in lines):  # the watch has them too
            assert time.monotonic() < deadline and watcher.poll() is None, lines
            time.sleep(0.1)
        os.kill(watcher.pid, signal.SIGSTOP)  # away: its socket gets the drain's close, unread
        servers[0].terminate()
        servers.append(server().start())
        if producer_kind == "stream":
            with stream(servers[1].base_url, session.id, "?resume_from=4") as producer:
                assert json.loads(producer.recv(timeout=TIMEOUT_S))["frames_received"] == 4
                producer.send(save({"latents": latents[:, :, 4:].copy()}))
                producer.send(json.dumps({"type": "flush"}))
                units(producer, 3)  # [4, 7), [7, 10), [10, 13), while the watch is away
        else:
            session.send(latents[:, :, 4:])
            session.flush()
        os.kill(watcher.pid, signal.SIGCONT)
        watcher.wait(timeout=TIMEOUT_S)
        reader.join(TIMEOUT_S)  # stdout is the reader's alone (communicate() would take lines from it)
        err = watcher.stderr.read()
    finally:
        client.close()
        if watcher is not None and watcher.poll() is None:
            os.kill(watcher.pid, signal.SIGCONT)
            watcher.kill()
        for process in servers:
            process.kill()
    assert "restarting (close 1012)" in err
    watched = load_file(str(tmp_path / "watched.safetensors"))["latents"]
    if kept == 1:
        assert watcher.returncode == 2, err
        assert "error: frames [4, 13) were refined while the watch reconnected and the server no longer keeps" in err
        assert np.array_equal(watched, expected[:, :, :4])
        return
    assert watcher.returncode == 0, err
    assert f"session {session.id} is flushed" in "".join(lines)
    assert re.findall(r"^frames \[(\d+), (\d+)\)", "".join(lines), re.M) == [
        ("1", "4"), ("4", "7"), ("7", "10"), ("10", "13")]  # each block once, the replayed ones included
    assert np.array_equal(watched, expected)
