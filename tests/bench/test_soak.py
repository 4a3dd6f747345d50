"""The soak (``python -m bench.soak``): 8 WebSocket sessions x 50 blocks against a real server process, with
seeded random drops and one SIGTERM + restart; every frame checked bit for bit against the session refined alone,
memory flat, and the server batching the sessions' forwards all along. See bench/soak.py."""

from __future__ import annotations

from bench.soak import SoakConfig, run_soak


def test_soak_survives_drops_and_a_restart_without_losing_a_frame(tmp_path):
    config = SoakConfig()
    figures = run_soak(config, tmp_path)  # raises SoakFailure with the reason on any loss, mismatch or growth
    print(figures)
    assert figures["frames_checked"] == config.sessions * config.frames
    assert figures["restarts"] == 1 and figures["snapshots_written"] == config.sessions
    assert figures["snapshots_left_at_end"] == 0, "every session was adopted on its first request"
    assert figures["disconnects_injected"] > 0
    assert figures["rss_flat"]
    # Batching is on by default: many model calls carried several sessions' forwards, and still every frame above
    # equals its session refined alone.
    assert figures["model_calls_with_several_sessions"] > 0 and figures["mean_rows_per_model_call"] > 1
