"""``python -m bench encode`` runs and reports every setting; the figures that are not timings hold (a higher JPEG
quality costs bytes and buys PSNR; the natural clip clears the issue's goal at its default settings)."""

from __future__ import annotations

from bench.encode import SETTINGS, format_report, measure_codecs, measure_watchers, natural_clip


def test_codec_figures_cover_every_setting_and_order_by_quality():
    rows = measure_codecs(natural_clip(6, 96, 160), unit_frames=4)
    assert [(r["format"], r["quality"]) for r in rows] == SETTINGS
    by = {(r["format"], r["quality"]): r for r in rows}
    assert by["jpeg", 95]["bytes_per_frame"] > by["jpeg", 85]["bytes_per_frame"] > by["jpeg", 75]["bytes_per_frame"]
    assert by["jpeg", 95]["psnr_mean_db"] > by["jpeg", 75]["psnr_mean_db"]
    assert by["h264", 28]["bytes_per_frame"] < by["h264", 23]["bytes_per_frame"]
    for r in rows:
        assert r["encode_ms_per_frame"] > 0 and r["psnr_min_db"] <= r["psnr_mean_db"]
        assert r["ratio_vs_raw"] >= 10 and r["psnr_mean_db"] >= 35, r  # the goal, on natural content


def test_the_latency_phases_run_against_a_real_server():
    watchers = measure_watchers(2, blocks=1, threads=1, pixels=(64, 96))
    assert list(watchers) == ["no watcher", "2 JPEG watchers", "no watcher (again)"]
    assert all(r["blocks"] == 1 and r["p50_ms"] > 0 for r in watchers.values())
    assert all(units >= 2 for units in watchers["2 JPEG watchers"]["units_per_watcher"])
    report = {"command": "python -m bench encode", "cpu": "x", "frames": 6, "unit_frames": 4,
              "codecs": {"clip": measure_codecs(natural_clip(2, 32, 64), 2)}, "watchers": watchers}
    text = format_report(report)
    assert "| jpeg | q 85 |" in text and "| 2 JPEG watchers | 1 |" in text
