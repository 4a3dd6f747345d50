"""The soak (``python -m app.soak``): 8 WebSocket sessions x 50 blocks against a real server process, with
seeded random drops and one SIGTERM + restart; every frame checked bit for bit, memory flat. See app/soak.py."""

from __future__ import annotations

from app.soak import SoakConfig, run_soak


def test_soak_survives_drops_and_a_restart_without_losing_a_frame(tmp_path):
    config = SoakConfig()
    figures = run_soak(config, tmp_path)  # raises SoakFailure with the reason on any loss, mismatch or growth
    print(figures)
    assert figures["frames_checked"] == config.sessions * config.frames
    assert figures["restarts"] == 1 and figures["snapshots_written"] == config.sessions
    assert figures["snapshots_left_after_restore"] == 0
    assert figures["disconnects_injected"] > 0
    assert figures["rss_flat"]
