"""The live view (GET /view) in a real headless Chromium, against a real server with a VAE.

The page attaches to a session through ``?session=ID`` (or a click in its list), the test streams a clip over
HTTP, and the page must have drawn every pixel frame of the session's video (F = 8(T-1)+1-S) and charted one bar
per refined block, the blocks the HTTP responses finalized; the canvas must show the video's last frame: exactly
when the page plays the session's raw frames (``&format=raw``), within the codec's error when it plays JPEG (its
default) or H.264 (MediaSource): PSNR against the server's uint8 frame above ``PSNR_BOUND_DB``. With an
API key the page lists nothing until the key is typed in, then watches with it (the WebSocket subprotocol form).

Needs Debian's ``chromium`` and ``chromium-driver`` (.ci/run installs them). ``WM_VIEW_SCREENSHOT=PATH`` saves a
screenshot of the page once the uint8 video has played (docs/view.png was made so).
"""

from __future__ import annotations

import io
import math
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from app.core.codec import decode_response

from tests.app.conftest import (
    DEADLINE_S, NGINX, OCTET, LiveServer, make_clip, nginx_prefix, nginx_prefixes, payload, wait_until,
)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)
# The tiny random VAE's frames are noise, the worst case for a codec (natural video at the same settings: >= 35 dB,
# tests/app/outputs/test_encoded_video.py, docs/benchmarks.md); measured here, drawn by Chromium against the server's uint8
# frame: JPEG q85 16.0 dB, H.264 CRF 23 15.4 dB. So besides that bound, the drawn frame must be nearer its own raw
# frame than any other frame of the video, and (JPEG) equal Pillow's decode of the same bytes within
# JPEG_DECODERS_DB (two libjpeg-turbo builds differ only in IDCT and chroma upsampling).
PSNR_BOUND_DB = {"jpeg": 14.0, "h264": 13.0}
JPEG_DECODERS_DB = 30.0
KEY = "wm>>>???key"  # base64 'd20+Pj4/Pz9rZXk=': the page must send it as base64url, unpadded


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory) -> Path:
    from models.checkpoints import write_vae_checkpoint

    return write_vae_checkpoint(tmp_path_factory.mktemp("tiny-vae"), "tiny-vae")


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--window-size=1280,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for browser.get_log("browser")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def page_state(browser) -> dict:
    """window.wmView plus the numbers and status the page shows (queued: the frames it has yet to draw)."""
    return browser.execute_script(
        """const text = (id) => document.getElementById(id).textContent;
        return {...window.wmView, status: text("status"), shown: {drawn: text("frames-drawn"),
                received: text("frames-received"), blocks: text("blocks-charted")},
                queued: parseInt(text("queued"))};"""
    )


def hide_page(browser) -> str:
    """Put the page in a background tab (another tab opened in front of it, as a user does); returns the page's
    window handle. The page is then ``opener`` of the front tab."""
    front = browser.current_window_handle
    browser.execute_script("window.open(location.origin + '/health', '_blank')")
    wait_until(lambda: len(browser.window_handles) == 2, "the second tab")
    browser.switch_to.window(next(handle for handle in browser.window_handles if handle != front))
    assert browser.execute_script("return opener.document.visibilityState") == "hidden"
    return front


def show_page(browser, front: str) -> None:
    """Bring the page ``hide_page`` hid back in front (the tab in front of it closed), and wait until it says so."""
    browser.close()
    browser.switch_to.window(front)
    wait_until(lambda: browser.execute_script("return document.visibilityState") == "visible", "the page in front")


def wait_for_page(browser, predicate, what: str) -> dict:
    return wait_until(lambda: (lambda state: predicate(state) and state)(page_state(browser)), f"the page: {what}")


def stream_clip(http: httpx.Client, session_id: str, config: dict, frames: int, headers=None):
    """Stream ``frames`` latent frames as chunks of at most one block each, then flush; returns the refined blocks
    ((frame_start, frame_end) of each) and the video tensors the HTTP responses carried, in the session's format."""
    sink, block = config["sink_frames"], config["block_size"]
    latents, embeds, mask = make_clip(frames=frames)
    bounds = [0, sink, *range(sink + block, frames, block), frames]
    blocks, video = [], []
    for seq, (start, end) in enumerate(zip(bounds, bounds[1:])):
        body = payload(latents[:, :, start:end], *((embeds, mask) if seq == 0 else ()))
        response = http.post(
            f"/v1/sessions/{session_id}/chunks", params={"seq": seq, "flush": end == frames}, content=body,
            headers={**OCTET, **(headers or {})},
        )
        assert response.status_code == 200, response.text
        tensors, metadata = decode_response(response.content)
        frame_start, frame_end = int(metadata["frame_start"]), int(metadata["frame_end"])
        if frame_end > max(frame_start, sink):  # each chunk past the sink completes at most one block
            blocks.append((max(frame_start, sink), frame_end))
        video.append(tensors["video"])
    return blocks, video


def canvas_frame(browser, height: int, width: int) -> tuple[float, list[int]]:
    """The scale the video canvas draws at and the RGB it shows at the centre of each source pixel, row-major (the
    page letterboxes, and draws unsmoothed when it enlarges 2x or more: then these are the frame's own values)."""
    return browser.execute_script(
        """const [h, w] = arguments, canvas = document.getElementById("video"), ratio = window.devicePixelRatio || 1;
        const cw = canvas.clientWidth, ch = canvas.clientHeight, scale = Math.min(cw / w, ch / h);
        const x0 = (cw - w * scale) / 2, y0 = (ch - h * scale) / 2;
        const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data, out = [];
        for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
          const px = Math.floor((x0 + (x + 0.5) * scale) * ratio), py = Math.floor((y0 + (y + 0.5) * scale) * ratio);
          const i = (py * canvas.width + px) * 4;
          out.push(data[i], data[i + 1], data[i + 2]);
        }
        return [scale, out];""",
        height, width,
    )


@pytest.mark.parametrize("video_format,page_format", [("uint8", "raw"), ("float32", "raw"), ("uint8", "jpeg"),
                                                      ("uint8", "h264")])
def test_the_page_plays_the_video_and_charts_every_block(make_settings, vae_dir, browser, video_format, page_format):
    latent_frames = 13
    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        # 6 blocks, 96 frames played in 3 s
        config = {"outputs": ["latents", "video"], "video_format": video_format, "block_size": 2, "fps": 32.0}
        created = http.post("/v1/sessions", json=config)
        assert created.status_code == 201, created.text
        session_id, config = created.json()["session_id"], created.json()["config"]
        shown_as = "" if page_format == "jpeg" else f"&format={page_format}"  # JPEG: the page's default
        browser.get(f"{server.base_url}/view?session={session_id}{shown_as}")
        wait_for_page(browser, lambda state: state["status"] == "attached", "attached")
        assert page_state(browser)["format"] == page_format

        blocks, video = stream_clip(http, session_id, config, latent_frames)
        expected = 8 * (latent_frames - 1) + 1 - config["sink_frames"]
        assert sum(part.shape[1] for part in video) == expected
        state = wait_for_page(browser, lambda state: state["done"] and state["framesDrawn"] >= expected,
                              f"{expected} frames drawn")
        if os.environ.get("WM_VIEW_SCREENSHOT") and video_format == "uint8" and page_format == "jpeg":
            row = f'#sessions li[data-session-id="{session_id}"]'
            wait_until(lambda: browser.execute_script(f"return document.querySelector('{row}')"), "the list")
            browser.save_screenshot(os.environ["WM_VIEW_SCREENSHOT"])

    assert state["framesReceived"] == state["framesDrawn"] == expected
    assert len(blocks) == 6
    assert [(b["frame_start"], b["frame_end"]) for b in state["blocks"]] == blocks
    assert all(b["latency_ms"] > 0 for b in state["blocks"])
    assert state["shown"] == {"drawn": str(expected), "received": str(expected), "blocks": str(len(blocks))}
    assert state["dropped"] == 0 and state["error"] is None
    assert state["status"] == "done"
    last = next(part for part in reversed(video) if part.shape[1])[0, -1]  # batch row 0
    if video_format == "float32":  # (3, H, W) in [0, 1] -> (H, W, 3) levels, as the page rounds them
        last = (last.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8)
    scale, shown = canvas_frame(browser, last.shape[0], last.shape[1])
    assert scale >= 2, f"the canvas shows the {tuple(last.shape)} frames at {scale:.2f}x: smoothed, not comparable"
    if page_format != "raw":  # decoded by the browser: within the codec's error
        drawn = torch.tensor(shown, dtype=torch.float64)
        psnr = psnr_db(drawn, last.flatten())
        assert psnr >= PSNR_BOUND_DB[page_format], f"{page_format}: {psnr:.2f} dB"
        frames = torch.cat(video, dim=1)[0]  # (F, H, W, 3), uint8
        nearest = min(range(frames.shape[0]), key=lambda f: (drawn - frames[f].flatten().double()).abs().mean().item())
        # H.264: the page draws the <video> at its "seeked" event, which Chromium may fire before the sought frame
        # is the one drawImage reads: seen once on a loaded machine, the one before the last (frame 94 of 96).
        # JPEG decodes each frame itself: exactly the last.
        last_ones = {frames.shape[0] - 1} | ({frames.shape[0] - 2} if page_format == "h264" else set())
        assert nearest in last_ones, f"the page shows frame {nearest}, not the last one"
        if page_format == "jpeg":
            from PIL import Image

            from app.outputs.encoders import encode_jpeg

            encoded = encode_jpeg(last[None, None].numpy(), 85)  # what the watcher was sent: quality "auto"
            pillow = torch.from_numpy(np.asarray(Image.open(io.BytesIO(encoded.data)).convert("RGB")).copy())
            assert psnr_db(drawn, pillow.flatten()) >= JPEG_DECODERS_DB
        return
    # uint8: the frame's own bytes; float32: the page scales in float64, so a value on a rounding tie may go either way
    difference = (torch.tensor(shown, dtype=torch.int16) - last.flatten().to(torch.int16)).abs().max().item()
    assert difference <= (0 if video_format == "uint8" else 1)


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    error = (a.double() - b.double()).pow(2).mean().item()
    return 10 * math.log10(255**2 / max(error, 1e-12))


def test_with_an_api_key_the_page_lists_and_watches_once_the_key_is_entered(make_settings, vae_dir, browser):
    from selenium.webdriver.common.by import By

    latent_frames = 4
    auth = {"authorization": f"Bearer {KEY}"}
    with LiveServer(make_settings(vae=str(vae_dir), api_key=KEY)) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        assert http.get("/view").status_code == 200  # the page itself needs no key
        created = http.post("/v1/sessions", json={"outputs": ["video"], "fps": 32.0}, headers=auth)
        assert created.status_code == 201, created.text
        session_id, config = created.json()["session_id"], created.json()["config"]
        row = f'#sessions li[data-session-id="{session_id}"]'

        browser.get(f"{server.base_url}/view")
        note = lambda: browser.find_element(By.ID, "sessions-note").text
        wait_until(lambda: "API key" in note(), "the page to ask for the key")
        assert browser.find_elements(By.CSS_SELECTOR, "#sessions li") == []
        browser.find_element(By.ID, "api-key").send_keys(KEY)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, row), "the session in the list")
        browser.find_element(By.CSS_SELECTOR, row).click()
        wait_for_page(browser, lambda state: state["status"] == "attached", "attached with the key")

        stream_clip(http, session_id, config, latent_frames, headers=auth)
        expected = 8 * (latent_frames - 1) + 1 - config["sink_frames"]
        state = wait_for_page(browser, lambda state: state["done"] and state["framesDrawn"] >= expected,
                              f"{expected} frames drawn")
        assert state["framesDrawn"] == expected and state["error"] is None
        assert len(state["blocks"]) == 1

        # The key is remembered: a reload lists the sessions without asking again.
        browser.refresh()
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, row), "the session listed after a reload")
        assert browser.find_element(By.ID, "api-key").get_attribute("value") == KEY


def test_a_watch_the_server_refuses_shows_the_servers_reason(make_settings, browser):
    """The browser shows the page a refused watch only as close 1006; the page says the reason the module found
    (here max_watchers, the one place taken by another watcher), not a guess."""
    from websockets.sync.client import connect

    with LiveServer(make_settings(max_watchers=1)) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        session_id = http.post("/v1/sessions", json={}).json()["session_id"]
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/watch"):
            wait_until(lambda: http.get(f"/v1/sessions/{session_id}").json()["watchers"] == 1, "the other watcher")
            browser.get(f"{server.base_url}/view?session={session_id}")
            state = wait_for_page(browser, lambda state: state["status"] == "error", "the refusal")
            shown = browser.execute_script("return document.getElementById('error').textContent")
    assert "closed before it opened" in shown and "max_watchers" in shown, shown
    assert state["framesReceived"] == 0


def test_without_the_key_the_page_asks_for_the_list_once_not_every_refresh(make_settings, browser):
    """Refused for want of a key, the page stops its 2-s listing (each refusal is an error line in the console)
    until a key is entered or Refresh is clicked."""
    from selenium.webdriver.common.by import By

    def refusals() -> int:
        return sum("/v1/sessions" in entry["message"] and "401" in entry["message"]
                   for entry in browser.get_log("browser"))

    with LiveServer(make_settings(api_key=KEY)) as server:
        browser.get(f"{server.base_url}/view")
        wait_until(lambda: "API key" in browser.find_element(By.ID, "sessions-note").text, "the page to ask for the key")
        browser.set_script_timeout(DEADLINE_S)
        browser.execute_async_script("setTimeout(arguments[0], 5000)")  # past two of the page's 2-s refreshes
        assert refusals() == 1
        browser.find_element(By.ID, "refresh").click()
        assert wait_until(refusals, "the listing asked again on Refresh") == 1


def test_after_a_restart_the_page_watches_the_session_again(tmp_path, browser):
    """A drain closes the page's watcher with 1012 (the session saved): the page says it is reconnecting, waits out
    the drain, the stop and the next server's start on the same port and snapshot_dir, and watches the session
    again: the next chunk's block is charted."""
    from bench.live import ServerProcess, free_port

    port = free_port()

    def server() -> ServerProcess:
        return ServerProcess(port, tmp_path / "cache", tmp_path / "snapshots", tmp_path / "server.log",
                             batching=False).start()

    latents, embeds, mask = make_clip(frames=7)
    first = server()
    try:
        with httpx.Client(base_url=first.base_url, timeout=DEADLINE_S) as http:
            session_id = http.post("/v1/sessions", json={"block_size": 3}).json()["session_id"]
            browser.get(f"{first.base_url}/view?session={session_id}")
            wait_for_page(browser, lambda state: state["status"] == "attached", "attached")
            assert http.post("/v1/admin/drain").json()["sessions_saved"] == 1
            wait_for_page(browser, lambda state: state["status"] == "reconnecting", "reconnecting after the drain")
        assert first.terminate() in (0, -15), first.log()
    finally:
        first.kill()
    second = server()
    try:
        with httpx.Client(base_url=second.base_url, timeout=DEADLINE_S) as http:
            wait_for_page(browser, lambda state: state["status"] == "attached", "attached again")
            response = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": 0},
                                 content=payload(latents[:, :, :4], embeds, mask), headers=OCTET)
            assert response.status_code == 200, response.text
            state = wait_for_page(browser, lambda state: len(state["blocks"]) == 1, "the block charted")
    finally:
        second.kill()
    assert [(b["frame_start"], b["frame_end"]) for b in state["blocks"]] == [(1, 4)]
    assert state["error"] is None


@pytest.mark.parametrize("kept_units", [None, 1], ids=["every-unit-kept", "a-gap"])
def test_after_a_drain_and_a_restart_the_page_resumes_from_the_frames_it_has(tmp_path, vae_dir, browser, kept_units):
    """The page watches a uint8 video session (as JPEG, its default) and has its first unit (frames [0, 3)) when
    its server drains. While the page keeps trying that server's port, another replica on the same snapshot_dir
    adopts the session, a stream there refines two more blocks and flushes, and that replica drains too; a third
    starts on the page's port. The page resumes from frame 3: the kept units come in the session's own format (the
    server keeps them as the session encoded them, and refuses a JPEG resume), each block charted once, then the
    flush's done, and it stops. With ws_resume_units=1 the third server keeps only the last unit: the page shows the
    gap and goes on from the first kept frame."""
    import json

    from websockets.sync.client import connect

    from bench.live import ServerProcess, free_port

    port, elsewhere = free_port(), free_port()
    starts = iter(range(3))

    def server(at: int, **settings) -> ServerProcess:
        return ServerProcess(at, tmp_path / "cache", tmp_path / "snapshots", tmp_path / f"server-{next(starts)}.log",
                             batching=False, vae=str(vae_dir), **settings).start()

    latents, embeds, mask = make_clip(frames=7)
    config = {"outputs": ["video"], "video_format": "uint8", "video_lookahead": 0, "block_size": 2, "fps": 32.0}
    first = server(port)
    try:
        with httpx.Client(base_url=first.base_url, timeout=DEADLINE_S) as http:
            session_id = http.post("/v1/sessions", json=config).json()["session_id"]
            browser.get(f"{first.base_url}/view?session={session_id}")
            wait_for_page(browser, lambda state: state["status"] == "attached", "attached")
            response = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": 0},
                                 content=payload(latents[:, :, :3], embeds, mask), headers=OCTET)
            assert response.status_code == 200, response.text
            frames = decode_response(response.content)[0]["video"].shape[1]
            wait_for_page(browser, lambda state: state["framesReceived"] == frames, "frames [0, 3)")
            assert http.post("/v1/admin/drain").json()["sessions_saved"] == 1
            wait_for_page(browser, lambda state: state["status"] == "reconnecting", "reconnecting after the drain")
        assert first.terminate() in (0, -15), first.log()
    finally:
        first.kill()

    other = server(elsewhere)  # not the page's: the page still finds its own port closed
    try:
        units = []
        with connect(f"{other.ws_url}/v1/sessions/{session_id}/stream?resume_from=3", open_timeout=DEADLINE_S,
                     max_size=None) as producer:
            assert json.loads(producer.recv(timeout=DEADLINE_S))["frames_received"] == 3
            producer.send(payload(latents[:, :, 3:5]))
            producer.send(payload(latents[:, :, 5:7]))
            producer.send(json.dumps({"type": "flush"}))
            while not isinstance(message := producer.recv(timeout=DEADLINE_S), str) or \
                    json.loads(message)["type"] != "done":
                if isinstance(message, bytes):
                    units.append(decode_response(message))
        assert httpx.post(f"{other.base_url}/v1/admin/drain", timeout=DEADLINE_S).json()["sessions_saved"] == 1
        assert other.terminate() in (0, -15), other.log()
    finally:
        other.kill()
    assert page_state(browser)["status"] == "reconnecting"
    bounds = [(int(meta["frame_start"]), int(meta["frame_end"])) for _, meta in units]
    assert bounds[:2] == [(3, 5), (5, 7)], bounds
    kept = units[-kept_units:] if kept_units else units
    kept_from = int(kept[0][1]["frame_start"])

    third = server(port, **({"ws_resume_units": kept_units} if kept_units else {}))
    try:
        state = wait_for_page(browser, lambda state: state["done"], "the flush's done")
        state = wait_for_page(browser, lambda state: state["framesDrawn"] == state["framesReceived"], "all drawn")
        wait_until(lambda: httpx.get(f"{third.base_url}/v1/sessions/{session_id}").json()["watchers"] == 0,
                   "the page to have closed its watch")
    finally:
        third.kill()
    assert state["status"] == "done" and state["error"] is None
    blocks = [(1, 3)] + [(int(m["frame_start"]), int(m["frame_end"])) for _, m in kept
                         if int(m["frame_end"]) > int(m["frame_start"])]
    assert [(b["frame_start"], b["frame_end"]) for b in state["blocks"]] == blocks  # each block once
    assert state["framesReceived"] == frames + sum(tensors["video"].shape[1] for tensors, _ in kept)
    assert state["held"] == 7
    assert state["gaps"] == ([[3, kept_from]] if kept_from > 3 else [])
    assert state["resumes"] == [{"from": max(3, kept_from), "ownFormat": True}]
    shown = browser.execute_script("return document.getElementById('note').textContent")
    assert "the session's own video format" in shown, shown
    assert (f"frames 3 to {kept_from} were no longer kept" in shown) == (kept_from > 3), shown


def test_a_watch_whose_connection_is_lost_resumes_from_the_frames_the_page_has(make_settings, browser):
    """The page reaches the server through a TCP proxy that resets every connection (the browser sees close 1006,
    no drain): it reconnects with resume_from= the frames it has, and the next chunk's block is charted once."""
    from tests.client.proxy import Proxy

    latents, embeds, mask = make_clip(frames=7)
    with LiveServer(make_settings()) as server, Proxy(server.port) as proxy, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        session_id = http.post("/v1/sessions", json={"block_size": 3}).json()["session_id"]
        browser.get(f"{proxy.base_url}/view?session={session_id}")
        wait_for_page(browser, lambda state: state["status"] == "attached", "attached")
        for seq, (start, end) in enumerate([(0, 4), (4, 7)]):
            if seq:
                assert proxy.cut() >= 1
                wait_for_page(browser, lambda state: state["status"] == "reconnecting", "reconnecting")
                wait_until(lambda: page_state(browser)["status"] == "attached"
                           and http.get(f"/v1/sessions/{session_id}").json()["watchers"] == 1, "watching again")
            response = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": seq},
                                 content=payload(latents[:, :, start:end], *((embeds, mask) if not seq else ())),
                                 headers=OCTET)
            assert response.status_code == 200, response.text
            state = wait_for_page(browser, lambda state: len(state["blocks"]) == seq + 1, f"block {seq} charted")
    assert [(b["frame_start"], b["frame_end"]) for b in state["blocks"]] == [(1, 4), (4, 7)]
    assert state["resumes"] == [{"from": 4, "ownFormat": False}] and state["gaps"] == []
    assert state["held"] == 7 and state["error"] is None


def test_a_watch_dropped_as_soon_as_it_opens_backs_off_rather_than_reopening_every_half_second(make_settings,
                                                                                                 browser):
    """The watch's connection goes through a TCP proxy that resets it each time the server has taken the watcher
    (opened, nothing sent yet: an idle session): no reconnection recovers, so each wait is longer than the one before
    and the status counts the attempts up; it once started over at attempt 1 after every reopened connection, and so
    reopened every half second for as long as the server or proxy kept doing that."""
    from tests.client.proxy import Proxy

    def detail() -> str:
        return browser.execute_script("return document.getElementById('status-detail').textContent")

    with LiveServer(make_settings()) as server, Proxy(server.port) as proxy, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        session_id = http.post("/v1/sessions", json={}).json()["session_id"]
        browser.get(f"{proxy.base_url}/view?session={session_id}")
        for attempt in range(1, 4):
            wait_until(lambda: page_state(browser)["status"] == "attached"
                       and http.get(f"/v1/sessions/{session_id}").json()["watchers"] == 1, f"watching ({attempt})")
            assert proxy.cut() >= 1
            wait_until(lambda: f"attempt {attempt}" in detail(), f"reconnecting, attempt {attempt}: {detail()}")
        assert page_state(browser)["error"] is None


def test_the_page_shows_a_realtime_sessions_late_blocks(make_settings, vae_dir, browser):
    """A realtime session whose engine clock runs 30 s behind (every block late): its line in the list and the
    stats' counter show its late blocks; a session that is not real time shows none."""
    from selenium.webdriver.common.by import By

    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        pacer = server.services.engine.pacer
        real_clock = pacer.clock
        pacer.clock = lambda: real_clock() + 30.0
        plain = http.post("/v1/sessions", json={}).json()["session_id"]
        created = http.post("/v1/sessions", json={"realtime": True, "outputs": ["video"]})
        assert created.status_code == 201, created.text
        session_id, config = created.json()["session_id"], created.json()["config"]
        stream_clip(http, session_id, config, 7)  # sink + 2 blocks
        assert http.get(f"/v1/sessions/{session_id}").json()["late_blocks"] == 2

        browser.get(f"{server.base_url}/view?session={session_id}")
        row = lambda sid: browser.find_element(By.CSS_SELECTOR, f'#sessions li[data-session-id="{sid}"]').text
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, f'#sessions li[data-session-id="{plain}"]'),
                   "both sessions listed")
        wait_until(lambda: "late 2" in row(session_id), "the list line to show 2 late blocks")
        assert "late" not in row(plain)
        wait_until(lambda: browser.find_element(By.ID, "late-blocks").text == "2", "the stats counter to show 2")



@pytest.mark.skipif(not os.path.exists(NGINX), reason="needs Debian's nginx (apt-get install nginx)")
def test_behind_a_proxy_under_a_path_prefix_the_page_lists_watches_and_plays(make_settings, vae_dir, browser,
                                                                             tmp_path):
    """nginx serves the server under /refiner/ and nothing of it at the root (docs/api.md "Behind a reverse proxy").
    The page at /refiner/view loads its module, lists the sessions and watches one through the prefix, over HTTP
    and the WebSocket, while a client streams the clip through the same prefix; it draws every frame. It had
    imported /static/wm-refiner.js and called the API at the page's origin: at the root, where nothing answers."""
    latent_frames = 7
    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            nginx_prefix(server.port, tmp_path / "nginx") as url, \
            httpx.Client(base_url=url, timeout=DEADLINE_S) as http:
        assert httpx.get(f"{url.removesuffix('/refiner')}/static/wm-refiner.js").status_code == 404  # not at the root
        # The server's redirect of a trailing slash stays under the prefix (the docs' proxy_redirect): it named the
        # origin's root, http://host/view.
        slash = httpx.get(f"{url}/view/?session=s", follow_redirects=True)
        assert (str(slash.url), slash.status_code) == (f"{url}/view?session=s", 200)
        created = http.post("/v1/sessions", json={"outputs": ["video"], "block_size": 2, "fps": 32.0})
        assert created.status_code == 201, created.text
        session_id, config = created.json()["session_id"], created.json()["config"]
        browser.get(f"{url}/view?session={session_id}")
        wait_for_page(browser, lambda state: state["status"] == "attached", "attached through the prefix")
        row = f'#sessions li[data-session-id="{session_id}"]'
        wait_until(lambda: browser.execute_script(f"return document.querySelector('{row}')"), "the session listed")

        blocks, video = stream_clip(http, session_id, config, latent_frames)
        expected = 8 * (latent_frames - 1) + 1 - config["sink_frames"]
        assert sum(part.shape[1] for part in video) == expected
        state = wait_for_page(browser, lambda state: state["done"] and state["framesDrawn"] >= expected,
                              f"{expected} frames drawn")
        page_url = browser.current_url

    assert state["framesReceived"] == state["framesDrawn"] == expected
    assert [(b["frame_start"], b["frame_end"]) for b in state["blocks"]] == blocks and len(blocks) == 3
    assert state["shown"] == {"drawn": str(expected), "received": str(expected), "blocks": str(len(blocks))}
    assert state["error"] is None and state["status"] == "done"
    assert page_url == f"{url}/view?session={session_id}"  # the page's own address keeps the prefix

def test_servers_under_two_prefixes_of_one_origin_each_keep_their_own_api_key(make_settings, browser, tmp_path):
    """Pages of one origin share its localStorage: behind a proxy that serves two servers under /a/ and /b/, the key
    entered on /a/view was stored under one name for the whole origin, so /b/view sent server A's key to server B
    (and showed it in its field), and entering B's replaced A's. Each page keeps the key of the server it is under;
    at the root the name is the one it always was (test_with_an_api_key_the_page_lists_and_watches_once_the_key_is_
    entered: a reload keeps it)."""
    from selenium.webdriver.common.by import By

    keys = {"/a/": "key-of-server-a", "/b/": "key-of-server-b"}
    with LiveServer(make_settings(api_key=keys["/a/"])) as a, LiveServer(make_settings(api_key=keys["/b/"])) as b, \
            nginx_prefixes({"/a/": a.port, "/b/": b.port}, tmp_path / "nginx") as urls:
        note = lambda: browser.find_element(By.ID, "sessions-note").text
        field = lambda: browser.find_element(By.ID, "api-key").get_attribute("value")
        for prefix in ("/a/", "/b/"):
            browser.get(f"{urls[prefix]}/view")
            wait_until(lambda: "API key" in note(), f"{prefix}view to ask for its key")
            assert field() == ""  # nothing entered for this server yet: not the other's key
            browser.find_element(By.ID, "api-key").send_keys(keys[prefix])
            browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
            wait_until(lambda: note() == "no sessions on this server yet", f"{prefix}view to list with its key")
        for prefix in ("/a/", "/b/"):  # each remembered its own
            browser.get(f"{urls[prefix]}/view")
            wait_until(lambda: note() == "no sessions on this server yet", f"{prefix}view to list with its key")
            assert field() == keys[prefix]


# --- a page on another origin (cors_origins, app/api/cors.py) ------------------------------------------------------
# What a web app on its own origin does: read /v1/info, create a session, read an error's JSON, open the stream's
# WebSocket with the key as subprotocol. Each step's outcome is recorded; a step the browser blocks is "blocked".
CROSS_ORIGIN_PAGE = """<!doctype html><meta charset="utf-8"><title>another origin</title><script>
async function probe(base, key) {
  const auth = {Authorization: "Bearer " + key}, out = {};
  const step = async (name, run) => { try { out[name] = await run(); } catch (e) { out[name] = "blocked"; } };
  await step("info", async () => { const r = await fetch(base + "/v1/info", {headers: auth});
    return [r.status, "limits" in (await r.json())]; });
  await step("create", async () => { const r = await fetch(base + "/v1/sessions", {method: "POST",
    headers: {...auth, "Content-Type": "application/json"}, body: "{}"});
    const body = await r.json(); out.session = body.session_id; return [r.status, typeof body.session_id]; });
  await step("error", async () => { const r = await fetch(base + "/v1/sessions/no-such-session");
    return [r.status, (await r.json()).error.code, r.headers.get("X-Replica") !== null]; });
  return out;
}
function openSocket(url, key) {
  const b64url = btoa(key).replace(/\\+/g, "-").replace(/\\//g, "_").replace(/=+$/, "");
  return new Promise((resolve) => {
    const ws = new WebSocket(url, ["wm-refiner", "wm-refiner.bearer." + b64url]);
    ws.onopen = () => { const protocol = ws.protocol; ws.close(); resolve(["open", protocol]); };
    ws.onclose = (event) => resolve(["closed", event.code]);
  });
}
</script>"""


@pytest.fixture
def page_server():
    """Serves CROSS_ORIGIN_PAGE on 127.0.0.1 and a free port: loaded as http://localhost:PORT and as
    http://127.0.0.1:PORT, two origins, both other than the API's (another port)."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = CROSS_ORIGIN_PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def run_probe(browser, page_url: str, server) -> dict:
    browser.get(page_url)
    browser.set_script_timeout(DEADLINE_S)
    out = browser.execute_async_script(
        "const done = arguments[arguments.length - 1]; probe(arguments[0], arguments[1]).then(done);",
        server.base_url, KEY)
    return out


def test_a_page_on_an_allowed_origin_calls_the_api_and_opens_the_websocket(make_settings, browser, page_server):
    allowed = f"http://localhost:{page_server}"
    with LiveServer(make_settings(api_key=KEY, cors_origins=allowed)) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        out = run_probe(browser, f"{allowed}/", server)
        assert out["info"] == [200, True]
        assert out["create"] == [201, "string"]
        assert out["error"] == [401, "unauthorized", True]  # the error's JSON and the exposed headers are readable
        session_id = out["session"]
        assert http.get(f"/v1/sessions/{session_id}", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        opened = browser.execute_async_script(
            "const done = arguments[arguments.length - 1]; openSocket(arguments[0], arguments[1]).then(done);",
            f"{server.ws_url}/v1/sessions/{session_id}/stream", KEY)
        assert opened == ["open", "wm-refiner"]

        # The same page from an origin not on the list: every step fails in the browser, the WebSocket with 403.
        out = run_probe(browser, f"http://127.0.0.1:{page_server}/", server)
        assert out == {"info": "blocked", "create": "blocked", "error": "blocked"}
        refused = browser.execute_async_script(
            "const done = arguments[arguments.length - 1]; openSocket(arguments[0], arguments[1]).then(done);",
            f"{server.ws_url}/v1/sessions/{session_id}/watch", KEY)
        assert refused == ["closed", 1006]  # what a page learns of a refused handshake
        assert server.services.metrics.rejected_requests.labels(reason="origin_not_allowed")._value.get() >= 1


# --- previews in the list (view.html's preview watchers; api.md "Previews") ----------------------------------------
def preview_image(browser, session_id: str) -> dict:
    """The preview <img> of the session's line in the list, as the browser decoded it."""
    return browser.execute_script(
        """const img = document.querySelector(`#sessions li[data-session-id="${arguments[0]}"] img.preview`);
        return img && {hidden: img.hidden, src: img.getAttribute("src"), width: img.naturalWidth,
                       height: img.naturalHeight, complete: img.complete};""",
        session_id,
    )


def watchers_of(http: httpx.Client) -> dict[str, int]:
    return {s["session_id"]: s["watchers"] for s in http.get("/v1/sessions").json()["sessions"]}


def test_the_list_shows_a_preview_of_each_session_that_produces_one(make_settings, vae_dir, browser):
    """A session with outputs [latents, preview] gets a watcher of the page asking ?outputs=preview; after a chunk
    its line shows an <img> of the session's preview_width, the newest unit's JPEG as the server encoded it. A
    latents-only session gets no watcher and no image."""
    import base64

    from app.core.codec import decode_response

    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        # video_lookahead 0: each unit's frames come with it (the exact look-ahead would hold this chunk's back).
        created = http.post("/v1/sessions", json={"outputs": ["latents", "preview"], "preview_width": 48,
                                                  "video_lookahead": 0})
        assert created.status_code == 201, created.text
        previewed = created.json()["session_id"]
        plain = http.post("/v1/sessions", json={}).json()["session_id"]

        browser.get(f"{server.base_url}/view")
        wait_until(lambda: watchers_of(http)[previewed] == 1, "the page's preview watcher")
        assert watchers_of(http)[plain] == 0
        assert browser.execute_script("return window.wmPreviews.watching") == [previewed]

        latents, embeds, mask = make_clip(frames=4, height=4, width=8)  # the sink and one block, a 2:1 video
        response = http.post(f"/v1/sessions/{previewed}/chunks", params={"seq": 0},
                             content=payload(latents, embeds, mask), headers=OCTET)
        assert response.status_code == 200, response.text
        tensors, metadata = decode_response(response.content)
        width, height = int(metadata["preview_width"]), int(metadata["preview_height"])
        assert (width, height) == (48, 24)
        newest = tensors["preview"][-int(tensors["preview_sizes"][0, -1]):].numpy().tobytes()  # row 0, last unit

        wait_until(lambda: browser.execute_script(f"return window.wmPreviews.shown['{previewed}']?.frameEnd") == 4,
                   "the block's preview shown")
        image = wait_until(lambda: (lambda i: i["complete"] and i["width"] and i)(preview_image(browser, previewed)),
                           "the preview decoded")
        assert not image["hidden"]
        assert (image["width"], image["height"]) == (width, height)
        prefix = "data:image/jpeg;base64,"
        assert image["src"].startswith(prefix) and base64.b64decode(image["src"][len(prefix):]) == newest

        other = preview_image(browser, plain)
        assert other["hidden"] and other["src"] is None and other["width"] == 0
        assert watchers_of(http)[plain] == 0


def test_the_page_watches_at_most_its_cap_of_previews_and_moves_a_slot_when_a_session_goes(make_settings, vae_dir,
                                                                                             browser):
    """Six sessions with previews, a cap of four: the server sees four watchers from the page, and still four a
    refresh later; a watched session deleted, its slot goes to one that was not watched."""
    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        ids = [http.post("/v1/sessions", json={"outputs": ["preview"]}).json()["session_id"] for _ in range(6)]
        browser.get(f"{server.base_url}/view")
        cap = browser.execute_script("return window.wmPreviews.max")
        assert cap == 4
        wait_until(lambda: sum(watchers_of(http).values()) == cap, f"{cap} preview watchers")
        time.sleep(2.5)  # past the page's next list refresh (every 2 s): it opened no more
        counts = watchers_of(http)
        assert sum(counts.values()) == cap and set(counts.values()) == {0, 1}
        watching = set(browser.execute_script("return window.wmPreviews.watching"))
        assert watching == {sid for sid, n in counts.items() if n == 1}

        gone = sorted(watching)[0]
        assert http.delete(f"/v1/sessions/{gone}").status_code == 204
        replacement = lambda: set(browser.execute_script("return window.wmPreviews.watching")) - watching
        wait_until(lambda: len(replacement()) == 1 and sum(watchers_of(http).values()) == cap, "a slot moved")
        counts = watchers_of(http)
        assert gone not in counts and sum(counts.values()) == cap
        assert replacement() <= set(ids) - watching


# --- previews when the session is parked or spilled, and when the server ends the watcher -----------------------
def preview_session(http: httpx.Client) -> tuple[str, int, int]:
    """A session with previews: its id, and the frame_end of its first block and its block size (latent frames:
    the first chunk holds the sink and a block, each later one a block)."""
    # video_lookahead 0: each unit's frames come with it (the exact look-ahead would hold a chunk's frames back).
    created = http.post("/v1/sessions", json={"outputs": ["latents", "preview"], "preview_width": 48,
                                              "video_lookahead": 0})
    assert created.status_code == 201, created.text
    config = created.json()["config"]
    return created.json()["session_id"], config["sink_frames"] + config["block_size"], config["block_size"]


def send_preview_chunk(http: httpx.Client, session_id: str, clip, seq: int, start: int, end: int) -> bytes:
    """Latent frames [start, end) of ``clip`` as chunk ``seq``; returns the JPEG of the unit's newest preview (batch
    row 0), the bytes the page must show."""
    latents, embeds, mask = clip
    body = payload(latents[:, :, start:end], *((embeds, mask) if seq == 0 else ()))
    response = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": seq}, content=body, headers=OCTET)
    assert response.status_code == 200, response.text
    tensors, _ = decode_response(response.content)
    return tensors["preview"][-int(tensors["preview_sizes"][0, -1]):].numpy().tobytes()


def wait_for_preview(browser, session_id: str, frame_end: int, jpeg: bytes) -> None:
    """The session's line shows the unit ending at ``frame_end``: exactly ``jpeg``, decoded by the browser."""
    import base64

    wait_until(lambda: browser.execute_script(
        f"return window.wmPreviews.shown['{session_id}']?.frameEnd") == frame_end, f"the preview of frame {frame_end}")
    image = wait_until(lambda: (lambda i: i["complete"] and i["width"] and i)(preview_image(browser, session_id)),
                       "the preview decoded")
    prefix = "data:image/jpeg;base64,"
    assert not image["hidden"] and image["src"].startswith(prefix)
    assert base64.b64decode(image["src"][len(prefix):]) == jpeg


def line_state(browser, session_id: str) -> str:
    """The state word of the session's line in the list (streaming, idle, parked, spilled, flushed)."""
    return browser.execute_script(
        """const li = document.querySelector(`#sessions li[data-session-id="${arguments[0]}"]`);
        return li ? li.querySelector(".meta span").textContent : null;""", session_id)


def test_a_parked_then_spilled_session_keeps_its_preview_and_is_watched_again_once_back(make_settings, vae_dir,
                                                                                         browser, tmp_path):
    """view.html's rule: a session that is not active is not watched (a watch would keep it off the disk). Parked,
    the page lets its watcher go and the line keeps the last preview and says "parked"; then it can spill (no
    watcher holds it) and says "spilled". The chunk that brings it back is answered over HTTP; within a list refresh
    the page watches it again, and the next unit's preview is shown, byte for byte."""
    settings = make_settings(vae=str(vae_dir), snapshot_dir=tmp_path / "spill", park_after_s=3600, spill_after_s=7200)
    with LiveServer(settings) as server, httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        session_id, first, block = preview_session(http)
        clip = make_clip(frames=first + 2 * block, height=4, width=8)  # a 2:1 video, previews 48x24
        browser.get(f"{server.base_url}/view")
        wait_until(lambda: watchers_of(http)[session_id] == 1, "the page's preview watcher")
        wait_for_preview(browser, session_id, first, send_preview_chunk(http, session_id, clip, 0, 0, first))

        services = server.services
        parking, handle = services.store.parking, services.registry.existing(session_id)
        assert server.on_loop(parking.park(handle, reason="test")).result(DEADLINE_S)
        wait_until(lambda: line_state(browser, session_id) == "parked", "the line to say parked")
        wait_until(lambda: watchers_of(http)[session_id] == 0, "the page to let the watcher go")
        assert browser.execute_script("return window.wmPreviews.watching") == []
        assert server.on_loop(parking.spill(handle)).result(DEADLINE_S), "a session nobody watches spills"
        assert http.get(f"/v1/sessions/{session_id}").json()["state"] == "spilled"
        wait_until(lambda: line_state(browser, session_id) == "spilled", "the line to say spilled")
        assert watchers_of(http)[session_id] == 0  # the page did not bring it back
        image = preview_image(browser, session_id)  # the last preview stays meanwhile
        assert not image["hidden"] and image["width"] == 48
        assert browser.execute_script(f"return window.wmPreviews.shown['{session_id}'].frameEnd") == first

        send_preview_chunk(http, session_id, clip, 1, first, first + block)  # adopted back from the file, refined
        assert http.get(f"/v1/sessions/{session_id}").json()["state"] == "active"
        wait_until(lambda: watchers_of(http)[session_id] == 1, "the page to watch it again")
        assert browser.execute_script("return window.wmPreviews.watching") == [session_id]
        wait_until(lambda: line_state(browser, session_id) == "idle", "the line to say idle (active, no stream)")
        end = first + 2 * block
        wait_for_preview(browser, session_id, end, send_preview_chunk(http, session_id, clip, 2, first + block, end))


async def _close_watchers(store, session_id: str, code: int, reason: str) -> int:
    """Close the session's watch sockets from the server's side, as a drain does (on the server's loop)."""
    closing = [c for c in store.connections if c.session_id == session_id and not c.is_closed]
    for connection in closing:
        connection.close(code, reason)
    return len(closing)


def test_a_preview_watcher_the_server_closes_is_opened_again_after_the_retry_delay(make_settings, vae_dir, browser):
    """The server closes the page's preview watcher (1012, as a drain closes its sockets): the page does not reopen
    it at once (PREVIEW_RETRY_MS, 10 s: a server refusing watchers is not hammered), keeps the last preview, then
    watches again at a list refresh past the delay, and shows the next unit's preview."""
    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        session_id, first, block = preview_session(http)
        end = first + block
        clip = make_clip(frames=end, height=4, width=8)
        browser.get(f"{server.base_url}/view")
        wait_until(lambda: watchers_of(http)[session_id] == 1, "the page's preview watcher")
        wait_for_preview(browser, session_id, first, send_preview_chunk(http, session_id, clip, 0, 0, first))

        store = server.services.store
        assert server.on_loop(_close_watchers(store, session_id, 1012, "restarting")).result(DEADLINE_S) == 1
        wait_until(lambda: browser.execute_script("return window.wmPreviews.watching").count(session_id) == 0,
                   "the page to see its watcher closed")
        closed_at = time.monotonic()
        time.sleep(2.5)  # past a list refresh (every 2 s): within the retry delay the page does not reopen it
        assert watchers_of(http)[session_id] == 0
        assert not preview_image(browser, session_id)["hidden"]
        wait_until(lambda: watchers_of(http)[session_id] == 1, "the page to watch it again", timeout=30)
        assert time.monotonic() - closed_at >= 9.0  # not before PREVIEW_RETRY_MS (less the poll's slack)
        wait_for_preview(browser, session_id, end, send_preview_chunk(http, session_id, clip, 1, first, end))


def test_a_page_in_a_background_tab_comes_back_live_not_as_far_behind_as_it_was_hidden(make_settings, vae_dir,
                                                                                        browser):
    """A live view left in a background tab, while the session goes on: it draws nothing there (nobody sees it, and
    browsers slow its timer to once a second, so its queue grew and, back in front, it played the backlog at fps:
    as far behind the session as it was away). It keeps only the newest frame, counting the others as skipped, and
    back in front shows that frame: the session's last, exactly (raw uint8)."""
    sink, block, latent_frames = 1, 2, 9
    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        config = {"outputs": ["video"], "video_format": "uint8", "video_lookahead": 0, "block_size": block,
                  "fps": 32.0}  # each unit its own frames
        session_id = http.post("/v1/sessions", json=config).json()["session_id"]
        browser.get(f"{server.base_url}/view?session={session_id}&format=raw")
        wait_for_page(browser, lambda state: state["status"] == "attached", "attached")
        latents, embeds, mask = make_clip(frames=latent_frames)
        bounds = [0, sink, *range(sink + block, latent_frames, block), latent_frames]
        video = []

        def send(seq: int) -> None:
            start, end = bounds[seq], bounds[seq + 1]
            body = payload(latents[:, :, start:end], *((embeds, mask) if seq == 0 else ()))
            response = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": seq, "flush": end == latent_frames},
                                 content=body, headers=OCTET)
            assert response.status_code == 200, response.text
            video.append(decode_response(response.content)[0]["video"])

        for seq in range(2):  # in front: every frame drawn
            send(seq)
        shown = sum(part.shape[1] for part in video)
        before = wait_for_page(browser, lambda state: state["framesDrawn"] == state["framesReceived"] == shown > 0,
                               "the first frames drawn")

        front = hide_page(browser)
        for seq in range(2, len(bounds) - 1):  # the session goes on while the page is hidden
            send(seq)
        total = sum(part.shape[1] for part in video)
        hidden = wait_until(lambda: (lambda view: view["framesReceived"] == total and view)(
            browser.execute_script("return opener.wmView")), "every frame received in the background")
        queued = browser.execute_script("return opener.document.getElementById('queued').textContent")
        assert hidden["framesDrawn"] == before["framesDrawn"], "frames drawn in a hidden tab"

        show_page(browser, front)
        state = wait_for_page(browser, lambda state: state["framesDrawn"] > before["framesDrawn"]
                              and not state["queued"], "the newest frame drawn in front, nothing left queued")
        assert state["framesDrawn"] == before["framesDrawn"] + 1, (state, before)  # not the backlog played out
        assert state["framesSkipped"] == total - shown - 1, (state, queued)
        last = next(part for part in reversed(video) if part.shape[1])[0, -1]
        scale, drawn = canvas_frame(browser, last.shape[0], last.shape[1])
        assert scale >= 2
        assert torch.equal(torch.tensor(drawn, dtype=torch.uint8), last.flatten())


def test_in_a_background_tab_the_h264_player_holds_only_the_last_drawn_and_the_newest_unit(make_settings, vae_dir,
                                                                                          browser):
    """The page plays H.264 through a MediaSource. In a background tab it draws nothing, so the video element never
    moves on; each unit's segment was still appended, so the MediaSource grew with every unit for as long as the tab
    was hidden. It holds only the unit under the element's position (the last drawn) and what the page may still
    draw: hidden, the newest unit (units are removed whole, each its own GOP). Back in front that unit's last frame
    is drawn: the seek to it completes (it once never did, the data under the position removed)."""
    sink, block, latent_frames, fps = 1, 2, 13, 32.0
    with LiveServer(make_settings(vae=str(vae_dir))) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S) as http:
        config = {"outputs": ["video"], "video_format": "uint8", "video_lookahead": 0, "block_size": block, "fps": fps}
        session_id = http.post("/v1/sessions", json=config).json()["session_id"]
        browser.get(f"{server.base_url}/view?session={session_id}&format=h264")
        wait_for_page(browser, lambda state: state["status"] == "attached", "attached")
        assert page_state(browser)["format"] == "h264"
        latents, embeds, mask = make_clip(frames=latent_frames)
        bounds = [0, sink, *range(sink + block, latent_frames, block), latent_frames]
        units = []  # (video_frame_start, video_frame_end) of each unit

        def send(seq: int) -> None:
            start, end = bounds[seq], bounds[seq + 1]
            body = payload(latents[:, :, start:end], *((embeds, mask) if seq == 0 else ()))
            response = http.post(f"/v1/sessions/{session_id}/chunks", params={"seq": seq}, content=body, headers=OCTET)
            assert response.status_code == 200, response.text
            metadata = decode_response(response.content)[1]
            units.append((int(metadata["video_frame_start"]), int(metadata["video_frame_end"])))

        for seq in range(2):  # in front: every frame drawn
            send(seq)
        shown = units[-1][1] - units[0][0]
        before = wait_for_page(browser, lambda state: state["framesDrawn"] == state["framesReceived"] == shown > 0,
                               "the first frames drawn")

        front = hide_page(browser)
        for seq in range(2, len(bounds) - 1):  # five more units, 2.5 s of video, while the page is hidden
            send(seq)
        total, (newest_start, newest_end) = units[-1][1] - units[0][0], units[-1]
        hidden = wait_until(lambda: (lambda view: view["framesReceived"] == total and view["videoBuffered"]
                                     and view["videoBuffered"][-1][1] >= (newest_end - 1) / fps and view)(
            browser.execute_script("return opener.wmView")), "the newest unit in the MediaSource")
        assert hidden["framesDrawn"] == before["framesDrawn"], "frames drawn in a hidden tab"
        assert hidden["error"] is None
        held = hidden["videoBuffered"]  # [start, end) s; a browser may round a range's ends by under a frame
        drawn_start, drawn_end = next(unit for unit in units if unit[0] < units[1][1] <= unit[1])  # the last drawn
        assert len(held) == 2, (held, units)
        assert (drawn_start - 1) / fps <= held[0][0] and held[0][1] <= (drawn_end + 1) / fps, (held, units)
        assert held[1][0] >= (newest_start - 1) / fps, (held, units)  # nothing between the two units

        show_page(browser, front)
        state = wait_for_page(browser, lambda state: state["framesDrawn"] > before["framesDrawn"]
                              and not state["queued"], "the newest frame drawn in front, nothing left queued")
    assert state["framesDrawn"] == before["framesDrawn"] + 1, (state, before)
    assert state["framesSkipped"] == total - shown - 1
    assert state["error"] is None
