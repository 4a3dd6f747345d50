"""The JavaScript client (app/static/wm-refiner.js, GET /static/wm-refiner.js) in a real headless Chromium.

A page on the server's origin imports the module and drives the service with it: safetensors written by Python
decode in the browser and come back bit-identical, each dtype; values the browser rounds to F16/BF16 equal torch's
rounding; a clip streamed over the WebSocket, cut after two units and resumed with ``?resume_from``, a clip sent as
HTTP chunks (a repeated ``seq`` replayed) and a watcher's units all equal, bit for bit, what ``POST /v1/refine``
returns for the same clip to Python (the same block shapes by construction: the e2e test asserts the same
identity). With an API key, so the key travels as ``Authorization`` and as the WebSocket subprotocol.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import threading

import httpx
import pytest
import torch
from safetensors.torch import load, save

from tests.app.conftest import DEADLINE_S, OCTET, LiveServer, make_clip, payload, wait_until
from tests.app.api.test_view_browser import CHROMEDRIVER, CHROMIUM, KEY, browser, page_server  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)
AUTH = {"authorization": f"Bearer {KEY}"}

# Runs in the page: imports the module (from args[0]), then runs the body args[1] as an async function of the module
# `m`, base64 helpers `b64` and the remaining arguments `args`; its result (or the error) goes back to Python.
HARNESS = """
const done = arguments[arguments.length - 1], [url, ...args] = Array.from(arguments).slice(0, -1);
const b64 = {
  decode: (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0)),
  encode: (bytes) => { let s = ""; for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000)); return btoa(s); },
};
import(url)
  .then((m) => (new Function("m", "b64", "args", "return (async () => {" + args[0] + "})();"))(m, b64, args.slice(1)))
  .then((value) => done({ value }), (err) => done({ error: String(err && err.stack || err) }));
"""


def run_js(browser, body: str, *args, module: str = "/static/wm-refiner.js"):
    browser.set_script_timeout(DEADLINE_S)
    out = browser.execute_async_script(HARNESS, module, body, *args)
    assert "error" not in out, out["error"]
    return out["value"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, so NaNs and -0.0 compare by their bits."""
    return tensor.contiguous().view(torch.uint8)


def test_the_module_is_served_as_javascript_without_the_key(make_settings):
    with LiveServer(make_settings(api_key=KEY)) as server, httpx.Client(base_url=server.base_url) as http:
        response = http.get("/static/wm-refiner.js")  # no key, like /view
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/javascript; charset=utf-8"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert "export class RefinerClient" in response.text
        assert http.get("/static/view.html").status_code == 401  # nothing else under /static is public
        assert http.get("/static/view.html", headers=AUTH).status_code == 404  # nor served at all
        assert "script-src 'self'" in http.get("/view").headers["content-security-policy"]


# F16/BF16 cases: exact ties (to even), the largest finite values and past them, subnormals, underflow, specials.
SOURCE = torch.tensor(
    [0.0, -0.0, 1.0, -2.5, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65504.0, 65519.0, 65520.0, 1e6,
     2**-24, 2**-25, 1.5 * 2**-24, 2**-14 - 2**-25, 1e-30, 1e-40, 3.0e38, float("inf"), float("-inf"), float("nan")],
    dtype=torch.float32,
)


def test_safetensors_round_trip_of_each_dtype(make_settings, browser):
    generator = torch.Generator().manual_seed(0)
    random = torch.randn(2, 3, 50, generator=generator) * torch.logspace(-8, 8, 50)
    tensors = {
        "f32": torch.cat([SOURCE, random.flatten()]).reshape(2, -1),
        "f16": torch.cat([SOURCE, random.flatten()]).to(torch.float16),
        "bf16": torch.cat([SOURCE, random.flatten()]).to(torch.bfloat16).reshape(1, 1, -1),
        "i64": torch.tensor([[-(2**63), -(2**53) - 1, -1, 0], [1, 2**53 + 1, 2**62, 2**63 - 1]], dtype=torch.int64),
        "i32": torch.tensor([-(2**31), -1, 0, 7, 2**31 - 1], dtype=torch.int32),
        "u8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
        "bool": torch.tensor([[True, False, True]]),
        "empty": torch.zeros(1, 128, 0, 4, 4),  # a flush's 0-frame latents
    }
    metadata = {"frame_start": "0", "frame_end": "4", "note": "ünïcode"}
    source = torch.cat([SOURCE, random.flatten()])
    with LiveServer(make_settings(api_key=KEY)) as server:
        browser.get(f"{server.base_url}/health")  # a page of the server's origin (no CSP), to import from
        out = run_js(browser, """
            const [file, source] = [b64.decode(args[0]), new Float32Array(b64.decode(args[1]).buffer)];
            const { tensors, metadata } = m.decodeSafetensors(file);
            const show = (v) => (Object.is(v, -0) ? "-0" : String(v));  // String(-0) is "0"
            const described = Object.fromEntries(Object.entries(tensors).map(([name, t]) =>
              [name, { dtype: t.dtype, shape: t.shape, values: Array.from(t.dtype === "I64" ? t.data : t.toFloat32(), show) }]));
            const again = m.encodeSafetensors(tensors, metadata);
            const built = m.encodeSafetensors({
              f16: m.Tensor.from("F16", [source.length], source), bf16: m.Tensor.from("BF16", [source.length], source),
              f32: m.Tensor.from("F32", [2], [1.5, -0]), i64: m.Tensor.from("I64", [3], [-1, 2n ** 62n, 3]),
              i32: m.Tensor.from("I32", [2], [-5, 6]), u8: m.Tensor.from("U8", [2], [0, 255]),
              bool: m.Tensor.from("BOOL", [1, 3], [true, false, 1]),
            });
            const refusals = [];
            for (const bad of [() => m.Tensor.from("F64", [1], [1]), () => m.Tensor.from("F32", [2], [1]),
                               () => m.decodeSafetensors(new Uint8Array([255, 0, 0, 0, 0, 0, 0, 0, 123])),
                               () => m.encodeSafetensors({}, { n: 1 })]) {
              try { bad(); refusals.push(null); } catch (err) { refusals.push(err.message); }
            }
            return { described, metadata, again: b64.encode(again), built: b64.encode(built), refusals };
        """, b64(save(tensors, metadata=metadata)), b64(source.numpy().tobytes()))

    assert out["metadata"] == metadata
    for name, tensor in tensors.items():
        described = out["described"][name]
        assert described["dtype"] == {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                                      torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
                                      torch.bool: "BOOL"}[tensor.dtype]
        assert described["shape"] == list(tensor.shape)
        if tensor.dtype == torch.int64:  # exact, as decimal strings (BigInt)
            assert described["values"] == [str(v) for v in tensor.flatten().tolist()]
        else:  # the browser's float32 view (a JS number printed in full) equals torch's cast
            shown = torch.tensor([float(v) for v in described["values"]], dtype=torch.float64).to(torch.float32)
            expected = tensor.flatten().to(torch.float32)
            nan = expected.isnan()  # a NaN's payload does not survive the trip as text ("NaN"); its NaN-ness must
            assert torch.equal(shown.isnan(), nan), name
            assert torch.equal(bits(shown[~nan]), bits(expected[~nan])), name

    again = base64.b64decode(out["again"])
    header = struct.unpack("<Q", again[:8])[0]
    assert (8 + header) % 8 == 0, "the header is padded so the data is 8-byte aligned"
    back = load(again)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(bits(back[name]), bits(tensor)), name
    assert json.loads(again[8 : 8 + header])["__metadata__"] == metadata  # the browser's encoder keeps it

    built = load(base64.b64decode(out["built"]))
    assert torch.equal(bits(built["f16"]), bits(source.to(torch.float16))), "F16 rounding differs from torch's"
    nan = source.isnan()  # torch writes one NaN for bf16 (0x7FC0); any quiet NaN is a NaN
    assert torch.equal(bits(built["bf16"][~nan]), bits(source[~nan].to(torch.bfloat16)))
    assert built["bf16"][nan].isnan().all()
    assert torch.equal(bits(built["f32"]), bits(torch.tensor([1.5, -0.0])))
    assert built["i64"].tolist() == [-1, 2**62, 3] and built["i32"].tolist() == [-5, 6]
    assert built["u8"].tolist() == [0, 255] and built["bool"].tolist() == [[True, False, True]]

    unknown, count, not_safetensors, metadata_type = out["refusals"]
    assert unknown and "F64" in unknown and "F32, F16, BF16" in unknown
    assert count and "holds 2 values, got 1" in count
    assert not_safetensors and "header length 255" in not_safetensors
    assert metadata_type and "metadata values are strings" in metadata_type


def test_a_tensor_sliced_in_the_browser_equals_torchs_slice(make_settings, browser):
    """Tensor.slice(axis, start, end) of each axis (a clip fetched whole and sent in chunks) gives the bytes of
    torch's slice, for a float, a half and an integer dtype; an axis or range that does not exist is refused."""
    generator = torch.Generator().manual_seed(1)
    tensors = {"f32": torch.randn(2, 3, 5, 2, 3, generator=generator),
               "bf16": torch.randn(2, 3, 5, generator=generator).to(torch.bfloat16),
               "i64": torch.arange(24, dtype=torch.int64).reshape(4, 6)}
    with LiveServer(make_settings()) as server:
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, """
            const { tensors } = m.decodeSafetensors(b64.decode(args[0])), slices = {};
            for (const [name, tensor] of Object.entries(tensors)) {
              slices[name] = tensor.shape.map((size, axis) => [[1, 3], [0, size], [2, 2], [size - 1, size + 4]].map(
                ([start, end]) => { const part = tensor.slice(axis, start, end);
                                    return { shape: part.shape, bytes: b64.encode(part.bytes) }; }));
            }
            const refusals = [];
            for (const bad of [() => tensors.f32.slice(5, 0, 1), () => tensors.f32.slice(2, 3, 1), () => tensors.f32.slice(2, -1, 1)]) {
              try { bad(); refusals.push(null); } catch (err) { refusals.push(err.message); }
            }
            return { slices, refusals };
        """, b64(save(tensors)))
    for name, tensor in tensors.items():
        for axis, cases in enumerate(out["slices"][name]):
            for (start, end), got in zip([(1, 3), (0, tensor.shape[axis]), (2, 2),
                                          (tensor.shape[axis] - 1, tensor.shape[axis] + 4)], cases):
                expected = tensor.narrow(axis, start, min(end, tensor.shape[axis]) - start)
                assert got["shape"] == list(expected.shape), (name, axis, start, end)
                assert base64.b64decode(got["bytes"]) == bits(expected).numpy().tobytes(), (name, axis, start, end)
    bad_axis, backwards, negative = out["refusals"]
    assert bad_axis and "axis 5 of a 5-d tensor" in bad_axis and "give 0 to 4" in bad_axis
    assert backwards and "slice [3, 1)" in backwards and negative and "slice [-1, 1)" in negative


# Runs in the page: the clip's float32 latents (1, C, T, H, W), prompt and mask in; the units of each way out.
DRIVE = """
const [base, key, clipB64, clipShape, promptB64, promptShape, maskValues] = args;
const [B, C, T, H, W] = clipShape, clip = new Float32Array(b64.decode(clipB64).buffer);
const prompt = m.Tensor.from("F32", promptShape, new Float32Array(b64.decode(promptB64).buffer));
const mask = m.Tensor.from("I64", [1, maskValues.length], maskValues);
const frames = (start, end) => {  // latents[:, :, start:end] (B = 1): each channel's run of frames
  const out = new Float32Array(C * (end - start) * H * W), run = (end - start) * H * W;
  for (let c = 0; c < C; c++) out.set(clip.subarray((c * T + start) * H * W, (c * T + end) * H * W), c * run);
  return m.Tensor.from("F32", [B, C, end - start, H, W], out);
};
const first = (start, end) => ({ latents: frames(start, end), prompt_embeds: prompt, prompt_attention_mask: mask });
const latents = (unit) => ({ start: unit.frameStart, end: unit.frameEnd, shape: unit.tensors.latents.shape,
                             bytes: b64.encode(unit.tensors.latents.bytes) });
const client = new m.RefinerClient(base, { apiKey: key });
const out = { info: Object.keys(await client.info()).sort() };

// One shot, through the module.
out.refined = latents(await client.refine(first(0, T)));

// The stream: 5 frames, two units, the connection cut; resumed from the frames received, the rest, the flush.
const { session_id: streamed } = await client.createSession({});
let stream = client.stream(streamed), units = [];
await stream.send(first(0, 5));
for await (const message of stream) {
  if (message.type !== "unit") throw new Error("unexpected " + JSON.stringify(message));
  units.push(latents(message));
  if (units.length === 2) break;
}
out.cutAt = stream.framesReturned;
stream = stream.reconnect();
const session = await stream.receive();
out.session = session;
for (let at = session.frames_received; at < T; at += 3) await stream.send({ latents: frames(at, Math.min(T, at + 3)) });
await stream.flush();
out.events = [];
for await (const message of stream) message.type === "unit" ? units.push(latents(message)) : out.events.push(message);
out.closeCode = stream.closeEvent.code;
out.streamed = units;

// HTTP chunks with seq, watched: seq 1 sent twice (the stored answer), a wrong seq refused, then the flush.
const { session_id: chunked } = await client.createSession({}, { id: "js-chunks" });
const watch = client.watch(chunked, { outputs: ["latents"] });
await watch.opened;
out.chunks = [];
out.replayed = [];
const bounds = [[0, 3, 0], [3, 7, 1], [3, 7, 1], [7, T, 2]];
for (const [start, end, seq] of bounds) {
  if (seq === 2) {
    try { await client.sendChunk(chunked, { latents: frames(start, end) }, { seq: 7 }); } catch (err) {
      out.conflict = [err.status, err.code, err.detail];
    }
  }
  const unit = await client.sendChunk(chunked, start === 0 ? first(start, end) : { latents: frames(start, end) },
                                      { seq, flush: end === T });
  out.replayed.push(unit.replayed);
  if (!unit.replayed) out.chunks.push(latents(unit));
}
out.watched = [];
out.watchEvents = [];
for await (const message of watch) message.type === "unit" ? out.watched.push(latents(message)) : out.watchEvents.push(message.type);
await client.deleteSession(chunked);
try { await client.getSession(chunked); } catch (err) { out.deleted = [err.status, err.code]; }
return out;
"""


def test_a_page_streams_resumes_chunks_and_watches_with_the_module(make_settings, browser):
    latents, embeds, mask = make_clip(frames=11, seed=3)
    with LiveServer(make_settings(api_key=KEY)) as server, \
            httpx.Client(base_url=server.base_url, timeout=DEADLINE_S, headers=AUTH) as http:
        response = http.post("/v1/refine", content=payload(latents, embeds, mask), headers=OCTET)
        assert response.status_code == 200, response.text
        one_shot = load(response.content)["latents"]

        browser.get(f"{server.base_url}/health")
        out = run_js(browser, DRIVE, server.base_url, KEY, b64(latents.numpy().tobytes()), list(latents.shape),
                     b64(embeds.numpy().tobytes()), list(embeds.shape), mask.flatten().tolist())

    def clip(units: list[dict]) -> torch.Tensor:
        position = 0
        for unit in units:
            assert unit["start"] == position, f"unit starts at {unit['start']}, expected {position}"
            position = unit["end"]
        assert position == 11
        parts = [torch.frombuffer(bytearray(base64.b64decode(u["bytes"])), dtype=torch.float32).reshape(u["shape"])
                 for u in units]
        return torch.cat(parts, dim=2)

    assert {"model", "limits", "ready"} <= set(out["info"])
    assert torch.equal(clip([out["refined"]]), one_shot)

    assert out["cutAt"] == 4  # the sink frame, then the block [1, 4)
    assert out["session"]["type"] == "session" and out["session"]["frames_received"] == 5
    assert out["session"]["resume_from"] == 4
    assert out["events"] == [{"type": "done", "frames": 11}] and out["closeCode"] == 1000
    assert [(u["start"], u["end"]) for u in out["streamed"]] == [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]
    assert torch.equal(clip(out["streamed"]), one_shot)

    assert out["replayed"] == [False, False, True, False]
    assert torch.equal(clip(out["chunks"]), one_shot)
    status, code, detail = out["conflict"]
    assert (status, code) == (409, "seq_conflict") and "2" in detail  # names the seq it expects
    assert torch.equal(clip(out["watched"]), one_shot)
    assert out["watchEvents"][-1] == "done" and "block" in out["watchEvents"]
    assert out["deleted"] == [404, "session_not_found"]


def test_a_page_on_an_allowed_origin_imports_the_module(make_settings, browser, page_server):
    """A web app on its own origin (in cors_origins) imports the module from the server and calls the API with it;
    on an origin not listed, the import itself is blocked (a module script is fetched with CORS)."""
    allowed = f"http://localhost:{page_server}"
    with LiveServer(make_settings(api_key=KEY, cors_origins=allowed)) as server:
        module = f"{server.base_url}/static/wm-refiner.js"
        body = """const client = new m.RefinerClient(args[0], { apiKey: args[1] });
            const { session_id } = await client.createSession({ seed: 7 });
            return [(await client.getSession(session_id)).config.seed, "limits" in (await client.info())];"""
        browser.get(f"{allowed}/")
        assert run_js(browser, body, server.base_url, KEY, module=module) == [7, True]

        browser.get(f"http://127.0.0.1:{page_server}/")
        browser.set_script_timeout(DEADLINE_S)
        out = browser.execute_async_script(HARNESS, module, body, server.base_url, KEY)
        assert "error" in out and "Failed to fetch dynamically imported module" in out["error"]


def api_md_examples() -> list[list[str]]:
    """The lines of each HTML example in docs/api.md's section on the JavaScript module, in order."""
    from pathlib import Path

    text = (Path(__file__).parents[3] / "docs" / "api.md").read_text()
    section = text.split("## The JavaScript module", 1)[1].split("\n## ", 1)[0]
    return [block.split("\n", 1)[1].strip().splitlines() for block in section.split("```")[1::2]
            if block.startswith("html")]


# Runs in the page: two units arrive and are left unread, the connection is lost, the stream reconnects.
UNREAD_UNITS = """
const client = new m.RefinerClient(args[0]), { session_id } = await client.createSession({ block_size: 3 });
const latents = m.Tensor.from("F32", [1, 128, 5, 4, 4], new Float32Array(128 * 5 * 16).map(Math.random));
const prompt = m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32));
let stream = client.stream(session_id);
await stream.send({ latents, prompt_embeds: prompt });                 // the sink frame, then the block [1, 4)
while (stream.queue.length < 2) await new Promise((resolve) => setTimeout(resolve, 20));  // arrived, not read
const unread = stream.framesReturned;
stream = stream.reconnect();
const session = await stream.receive();
await stream.flush();
const units = [];
for await (const message of stream) units.push(message.type === "unit" ? [message.frameStart, message.frameEnd] : message.type);
return { unread, resumeFrom: session.resume_from, units };
"""


def test_a_unit_that_arrived_but_was_not_read_comes_again_after_reconnect(make_settings, browser):
    """framesReturned counts the units the page read, not those the socket received: two units queued unread when
    the connection is cut are sent again by the server after reconnect(), so the page misses none."""
    with LiveServer(make_settings()) as server:
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, UNREAD_UNITS, server.base_url)
    assert out["unread"] == 0 and out["resumeFrom"] == 0
    assert out["units"] == [[0, 1], [1, 4], [4, 5], "done"]


def test_api_md_lists_every_export_of_the_module():
    """docs/api.md's table of the module names each of its exports (a page reads the docs, not the source)."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[3]
    source = (root / "app" / "static" / "wm-refiner.js").read_text()
    exports = re.findall(r"^export (?:const|function|class) (\w+)", source, re.M)
    text = (root / "docs" / "api.md").read_text()
    table = text.split("## The JavaScript module", 1)[1].split("\nThe key: ", 1)[0]
    assert len(exports) > 10 and [name for name in exports if f"`{name}" not in table] == []


def test_the_example_in_api_md_runs(make_settings, browser):
    """docs/api.md's example, as written (its server's URL swapped for this one's), in the browser."""
    lines = api_md_examples()[0]
    assert lines[0] == '<script type="module">' and lines[-1] == "</script>"
    assert lines[1].startswith("import { RefinerClient, Tensor } from ")
    with LiveServer(make_settings()) as server:
        code = "\n".join(lines[2:-1]).replace("http://127.0.0.1:8000", server.base_url)
        body = ("const { RefinerClient, Tensor } = m, logged = [];\n"
                "const console = { log: (...values) => logged.push(JSON.parse(JSON.stringify(values, "
                "(k, v) => (ArrayBuffer.isView(v) ? v.length : v)))) };\n" + code + "\nreturn logged;")
        browser.get(f"{server.base_url}/health")
        logged = run_js(browser, body)
    assert logged[:2] == [["unit", 0, 1], ["unit", 1, 4]]
    assert logged[2:] == [[[1, 128, 3, 4, 4], 128 * 3 * 16], [[1, 128, 3, 4, 4], 128 * 3 * 16],
                          [[1, 128, 1, 4, 4], 128 * 16], [{"type": "done", "frames": 11}]]


# Runs in the page: the same clip to two sessions, over the stream (two messages and the flush) and as HTTP chunks
# (seq 0, no seq, then the flush with an empty body, repeated); each unit's frames, seq, latencyMs and latents, each
# chunk's round trip and the bytes each request's body had on the wire (fetch is wrapped to count them).
SEQ_AND_FLUSH = """
const [base, key, clipB64, clipShape, promptB64, promptShape, streamed, chunked] = args;
const [B, C, T, H, W] = clipShape, clip = new Float32Array(b64.decode(clipB64).buffer);
const prompt = m.Tensor.from("F32", promptShape, new Float32Array(b64.decode(promptB64).buffer));
const frames = (start, end) => {  // latents[:, :, start:end] (B = 1)
  const out = new Float32Array(C * (end - start) * H * W), run = (end - start) * H * W;
  for (let c = 0; c < C; c++) out.set(clip.subarray((c * T + start) * H * W, (c * T + end) * H * W), c * run);
  return m.Tensor.from("F32", [B, C, end - start, H, W], out);
};
const described = (unit) => ({ start: unit.frameStart, end: unit.frameEnd, seq: unit.seq, latencyMs: unit.latencyMs,
                               shape: unit.tensors.latents.shape, bytes: b64.encode(unit.tensors.latents.bytes) });
const bodies = [], fetchOriginal = globalThis.fetch;
globalThis.fetch = (url, init = {}) => {
  if (String(url).includes("/chunks")) bodies.push(init.body === undefined ? null : init.body.byteLength);
  return fetchOriginal(url, init);
};
const client = new m.RefinerClient(base, { apiKey: key }), out = { streamed: [], chunks: [] };

const stream = client.stream(streamed);
await stream.send({ latents: frames(0, 5), prompt_embeds: prompt });  // seq 0: the sink, block [1, 4)
await stream.send({ latents: frames(5, T) });                         // seq 1: block [4, 7)
await stream.flush();                                                 // seq 2: [7, T)
for await (const message of stream) if (message.type === "unit") out.streamed.push(described(message));

for (const [payload, options] of [[{ latents: frames(0, 5), prompt_embeds: prompt }, { seq: 0 }],
                                  [{ latents: frames(5, T) }, {}],            // no seq: counted all the same
                                  [null, { seq: 2, flush: true }],            // the flush without frames
                                  [null, { seq: 2, flush: true }]]) {         // again: the stored answer
  const started = performance.now();
  const unit = await client.sendChunk(chunked, payload, options);
  out.chunks.push({ ...described(unit), replayed: unit.replayed, roundTripMs: performance.now() - started });
}
try { await client.sendChunk(chunked, null); out.refused = null; } catch (err) { out.refused = err.message; }
out.bodies = bodies;
return out;
"""


def test_units_say_seq_and_latency_and_an_empty_flush_gets_what_a_python_watcher_gets(make_settings, browser):
    """seq and latencyMs of each unit the module reads (a stream's, an HTTP chunk's) and sendChunk(id, null, {flush:
    true}): a Python client watches both sessions. A stream unit's watcher copy is the stream's own bytes, so the
    page's seq and latencyMs equal, exactly, what the Python client read; an HTTP response says its chunk's seq
    (that of every unit the watcher got within its frames) and a latency within its round trip, a repeated seq
    the first answer's; the empty flush goes out as a 0-byte body and returns the watcher's last unit, bit for bit."""
    from wm_refiner_client import Client
    from wm_refiner_client.units import Unit

    latents, embeds, _ = make_clip(frames=9, seed=5)
    with LiveServer(make_settings(api_key=KEY)) as server, \
            Client(server.base_url, api_key=KEY, return_tensors="pt") as python:
        sessions = [python.session(name) for name in ("js-seq-streamed", "js-seq-chunked")]
        watched: dict[str, list] = {session.id: [] for session in sessions}
        threads = [threading.Thread(target=lambda s=session: watched[s.id].extend(s.watch())) for session in sessions]
        for thread in threads:
            thread.start()
        for session in sessions:  # subscribed before the page sends anything
            wait_until(lambda: session.state().raw["watchers"] == 1, f"the Python watcher of {session.id}")

        browser.get(f"{server.base_url}/health")
        out = run_js(browser, SEQ_AND_FLUSH, server.base_url, KEY, b64(latents.numpy().tobytes()),
                     list(latents.shape), b64(embeds.numpy().tobytes()), list(embeds.shape),
                     *(session.id for session in sessions))
        for thread in threads:
            thread.join(DEADLINE_S)
            assert not thread.is_alive()

    def latents_of(unit: dict) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(unit["bytes"])), dtype=torch.float32).reshape(unit["shape"])

    streamed_units, chunked_units = ([u for u in watched[s.id] if isinstance(u, Unit)] for s in sessions)
    # The stream: every unit as the Python watcher read it, seq and latency included (the same bytes).
    assert [(u["start"], u["end"], u["seq"]) for u in out["streamed"]] == [(0, 1, 0), (1, 4, 0), (4, 7, 1), (7, 9, 2)]
    assert [(u.frame_start, u.frame_end, u.seq, u.latency_ms) for u in streamed_units] == \
        [(u["start"], u["end"], u["seq"], u["latencyMs"]) for u in out["streamed"]]
    assert all(u["latencyMs"] > 0 for u in out["streamed"])
    for page, python_unit in zip(out["streamed"], streamed_units):
        assert torch.equal(latents_of(page), python_unit.latents)

    # HTTP chunks: one unit per response, its chunk's seq; the empty flush sent 0 bytes and was replayed.
    first, second, flush, again = out["chunks"]
    assert [(u["start"], u["end"], u["seq"], u["replayed"]) for u in out["chunks"]] == \
        [(0, 4, 0, False), (4, 7, 1, False), (7, 9, 2, False), (7, 9, 2, True)]
    assert out["bodies"][2:] == [0, 0] and all(size > 0 for size in out["bodies"][:2])
    assert out["refused"] and "null (no new frames) only with flush: true" in out["refused"]
    assert len(out["bodies"]) == 4, "the refused call must not reach the server"
    for unit in (first, second, flush):
        assert 0 < unit["latencyMs"] <= unit["roundTripMs"]
        inside = [u for u in chunked_units if unit["start"] <= u.frame_start and u.frame_end <= unit["end"]]
        assert inside and {u.seq for u in inside} == {unit["seq"]}
    assert again["latencyMs"] == flush["latencyMs"] and again["bytes"] == flush["bytes"]  # the stored bytes
    assert [(u.frame_start, u.frame_end, u.seq) for u in chunked_units] == [(0, 1, 0), (1, 4, 0), (4, 7, 1), (7, 9, 2)]
    assert torch.equal(latents_of(flush), chunked_units[-1].latents)
    assert torch.equal(torch.cat([latents_of(u) for u in (first, second, flush)], dim=2),
                       torch.cat([u.latents for u in chunked_units], dim=2))
    # The same clip split the same way: the stream and the chunks refine the same blocks, bit for bit.
    assert torch.equal(torch.cat([u.latents for u in streamed_units], dim=2),
                       torch.cat([u.latents for u in chunked_units], dim=2))


# Runs in the page: each refusal the module turns into an error, as the page's code catches it.
REFUSALS = """
const [base, key, deadPort] = args, calls = [], fetchOriginal = globalThis.fetch;
globalThis.fetch = (url, init) => { calls.push(String(url)); return fetchOriginal(url, init); };
const described = (err) => ({ name: err.name, isRefinerError: err instanceof m.RefinerError, status: err.status,
                              code: err.code, detail: err.detail, retryAfter: err.retryAfter, body: err.body,
                              cause: err.cause ? err.cause.name : null, stack: String(err.stack).split("\\n")[0] });
const caught = async (call) => { try { await call(); return null; } catch (err) { return described(err); } };
const client = new m.RefinerClient(base, { apiKey: key }), out = {};
out.wrongKey = await caught(() => new m.RefinerClient(base, { apiKey: "wrong" }).info());
const { session_id } = await client.createSession({});
out.full = await caught(() => client.createSession({}));  // max_sessions 1: no place left
const latents = m.Tensor.from("F32", [1, 128, 2, 4, 4], new Float32Array(128 * 2 * 16));
const prompt = m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32));
out.memory = await caught(() => client.sendChunk(session_id, { latents, prompt_embeds: prompt }));
const dead = new m.RefinerClient(`http://127.0.0.1:${deadPort}`);
calls.length = 0;
out.unreachable = await caught(() => dead.sendChunk("s", { latents }, { seq: 0, retries: 1, maxWaitMs: 10 }));
out.unreachableCalls = calls.length;
out.safetensors = await caught(() => m.decodeSafetensors(new Uint8Array(3)));
return out;
"""


def test_errors_are_refiner_errors_that_carry_the_servers_envelope(make_settings, browser):
    """Every refusal reaches the page as a RefinerError named so (what a console shows first), with the server's
    code, message and Retry-After and its whole JSON answer (``body``: the fields an error carries besides code and
    message, here insufficient_memory's byte counts); a request that got no answer is one too (status 0,
    ``unreachable``, naming cors_origins among the causes, the browser's TypeError as its cause), still retried by
    sendChunk with a seq."""
    from bench.live import free_port

    with LiveServer(make_settings(api_key=KEY, max_sessions=1, device_memory_budget=4096)) as server:
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, REFUSALS, server.base_url, KEY, free_port())

    for name in ("wrongKey", "full", "memory", "unreachable"):
        assert out[name]["name"] == "RefinerError" and out[name]["isRefinerError"], out[name]
        assert out[name]["stack"].startswith("RefinerError: "), out[name]["stack"]
    assert (out["wrongKey"]["status"], out["wrongKey"]["code"]) == (401, "unauthorized")
    assert "Authorization: Bearer" in out["wrongKey"]["detail"]
    assert out["wrongKey"]["body"] == {"error": {"code": "unauthorized", "message": out["wrongKey"]["detail"]}}
    assert (out["full"]["status"], out["full"]["code"]) == (503, "too_many_sessions")
    assert out["full"]["retryAfter"] > 0
    memory = out["memory"]
    assert (memory["status"], memory["code"]) == (503, "insufficient_memory")
    error = memory["body"]["error"]
    assert error["bytes_budget"] == 4096 and error["bytes_needed"] > 4096 and error["message"] == memory["detail"]
    unreachable = out["unreachable"]
    assert (unreachable["status"], unreachable["code"], unreachable["cause"]) == (0, "unreachable", "TypeError")
    assert "cors_origins" in unreachable["detail"] and unreachable["body"] is None
    assert out["unreachableCalls"] == 2  # the first try and its one retry: the same seq is safe to send again
    assert out["safetensors"]["name"] == "SafetensorsError" and not out["safetensors"]["isRefinerError"]


# Runs in the page (on the server's origin): a client per base URL, what it resolved to, or why it was refused.
BASE_URLS = """
const out = {};
for (const base of ["localhost:" + args[0], "127.0.0.1:" + args[0], "ws://127.0.0.1:" + args[0], "/", "/v1/..", args[1] + "/"]) {
  try { out[base] = new m.RefinerClient(base).baseUrl; } catch (err) { out[base] = [err.name, err.message]; }
}
const client = new m.RefinerClient("/"), { session_id } = await client.createSession({});  // a same-origin proxy's way
const stream = client.stream(session_id);
await stream.send({ latents: m.Tensor.from("F32", [1, 128, 1, 4, 4], new Float32Array(128 * 16)),
                    prompt_embeds: m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32)) });
out.unit = [(await stream.receive()).frameEnd, stream.ws.url];
stream.close();
return out;
"""


def test_a_base_url_without_a_scheme_is_refused_and_a_path_on_the_pages_origin_works(make_settings, browser):
    """"localhost:8000" (a URL of scheme "localhost"), "127.0.0.1:8000" (a relative path: HTTP to the page's own
    server) and a ws:// URL are refused by the constructor, saying what to give; a path on the page's origin (a
    same-origin proxy) resolves to an absolute URL, so its WebSockets work too (they threw "Invalid URL")."""
    with LiveServer(make_settings()) as server:
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, BASE_URLS, server.port, server.base_url)
    for base in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"ws://127.0.0.1:{server.port}"):
        name, message = out[base]
        assert name == "TypeError" and "http:// or https:// URL" in message and f'not "{base}"' in message
    assert out["/"] == out["/v1/.."] == out[f"{server.base_url}/"] == server.base_url
    frames, url = out["unit"]
    assert frames == 1 and url.startswith(f"{server.ws_url}/v1/sessions/")


# Runs in the page: WebSockets the server refuses at the handshake, and what `opened` (and a stream's send) says.
HANDSHAKES = """
const [base, key] = args, client = new m.RefinerClient(base, { apiKey: key }), out = {};
const refused = async (socket) => {
  try { await socket.opened; socket.close(); return null; } catch (err) {
    return { name: err.name, status: err.status, code: err.code, detail: err.detail, retryAfter: err.retryAfter,
             closeCode: socket.closeEvent.code };
  }
};
const { session_id } = await client.createSession({});
const latents = m.Tensor.from("F32", [1, 128, 1, 4, 4], new Float32Array(128 * 16));
const prompt = m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32));
out.wrongKey = await refused(new m.RefinerClient(base, { apiKey: "wrong" }).watch(session_id));
out.noSession = await refused(client.watch("no-such-session"));
const first = client.stream(session_id), watcher = client.watch(session_id);
await first.opened; await watcher.opened;
out.secondWatcher = await refused(client.watch(session_id));  // max_watchers 1
const second = client.stream(session_id);
try { await second.send({ latents }); out.sent = true; } catch (err) { out.inUse = [err.status, err.code, err.detail]; }
await first.send({ latents, prompt_embeds: prompt }); await first.flush();
for await (const message of first) {}
out.flushed = await refused(client.stream(session_id));
out.resumed = (await client.stream(session_id, { resumeFrom: 0 }).receive()).type;  // resumeFrom is taken
await client.request("POST", "/v1/admin/drain");
out.draining = await refused(client.watch(session_id));  // the session still answers GET: /ready says why
return out;
"""


def test_a_refused_websocket_says_why_though_the_browser_shows_only_1006(make_settings, browser):
    """A browser shows a page a refused handshake only as close 1006; the module asks the server over HTTP, so
    `opened` (and a stream's send) rejects with the refusal's own status and code: a wrong key 401, an unknown
    session 404, a second stream 409 stream_in_use, a stream on a flushed session 409 stream_closed, and what HTTP
    cannot tell (a watcher past max_watchers) handshake_refused, naming what else it may be; a draining server, which
    still answers the session's GET, 503 draining from /ready."""
    with LiveServer(make_settings(api_key=KEY, max_watchers=1)) as server:
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, HANDSHAKES, server.base_url, KEY)

    for name, status, code in [("wrongKey", 401, "unauthorized"), ("noSession", 404, "session_not_found"),
                               ("flushed", 409, "stream_closed"), ("secondWatcher", 0, "handshake_refused"),
                               ("draining", 503, "draining")]:
        refusal = out[name]
        assert refusal and (refusal["name"], refusal["status"], refusal["code"]) == ("RefinerError", status, code), refusal
        assert refusal["closeCode"] == 1006 and "closed before it opened" in refusal["detail"]
    assert "Authorization: Bearer" in out["wrongKey"]["detail"]  # the server's own words, through the GET
    assert "no-such-session" in out["noSession"]["detail"]
    assert "resumeFrom" in out["flushed"]["detail"]
    assert "max_watchers" in out["secondWatcher"]["detail"] and "cors_origins" in out["secondWatcher"]["detail"]
    assert "sent" not in out and out["inUse"][:2] == [409, "stream_in_use"] and "resumeFrom" in out["inUse"][2]
    assert out["resumed"] == "session"
    assert "GET /ready says" in out["draining"]["detail"] and out["draining"]["retryAfter"] > 0


# Runs in the page: a stream the server closed (after the flush's done, with 1000), then sent to.
SEND_AFTER_CLOSE = """
const client = new m.RefinerClient(args[0]), { session_id } = await client.createSession({});
const latents = m.Tensor.from("F32", [1, 128, 2, 4, 4], new Float32Array(128 * 2 * 16));
const prompt = m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32));
const stream = client.stream(session_id);
await stream.send({ latents, prompt_embeds: prompt });
await stream.flush();
for await (const message of stream) {}
const out = { closeCode: stream.closeEvent.code };
for (const [name, call] of [["send", () => stream.send({ latents })], ["flush", () => stream.flush()]]) {
  try { await call(); out[name] = "sent"; } catch (err) { out[name] = [err.name, err.code, err.detail]; }
}
return out;
"""


def test_a_stream_that_closed_refuses_to_send_instead_of_dropping_the_message(make_settings, browser):
    """After the server closed the stream, send and flush throw a RefinerError `closed` naming the close code and
    the way on; a browser's WebSocket would take the message, drop it, and only warn in the console."""
    with LiveServer(make_settings()) as server:
        browser.get(f"{server.base_url}/health")
        browser.get_log("browser")  # what loading the page logged
        out = run_js(browser, SEND_AFTER_CLOSE, server.base_url)
        console = [entry["message"] for entry in browser.get_log("browser")]
    assert out["closeCode"] == 1000
    for name in ("send", "flush"):
        assert out[name][:2] == ["RefinerError", "closed"], out[name]
        assert "code 1000" in out[name][2] and "reconnect()" in out[name][2]
    assert not [line for line in console if "CLOSED state" in line], console


def test_the_restart_example_in_api_md_runs(tmp_path, browser):
    """docs/api.md's example of a page outliving a restart, as written, against a real server process: the page's
    first flush waits until the test has drained the server (the stream closed with 1012, the session saved), then
    the page retries through the drain, the stop and the next server's start on the same port and snapshot_dir, and
    logs every frame once, in order, and done."""
    from bench.live import ServerProcess, free_port

    lines = api_md_examples()[1]
    assert lines[0] == '<script type="module">' and lines[-1] == "</script>"
    assert lines[1].startswith("import { RefinerClient, Tensor } from ")
    port = free_port()

    def server() -> ServerProcess:
        return ServerProcess(port, tmp_path / "cache", tmp_path / "snapshots", tmp_path / "server.log",
                             batching=False).start()

    first = server()
    try:
        code = "\n".join(lines[2:-1]).replace("http://127.0.0.1:8000", first.base_url)
        body = ("const { RefinerClient, Tensor } = m, logged = window.logged = [];\n"
                "const console = { log: (...values) => logged.push(JSON.parse(JSON.stringify(values))) };\n"
                "const flush = m.RefinerStream.prototype.flush;\n"  # the first flush waits for the drain
                "const drained = new Promise((resolve) => { window.drained = resolve; });\n"
                "m.RefinerStream.prototype.flush = async function () {\n"
                "  if (!window.flushing) { window.flushing = true; await drained; }\n"
                "  return flush.call(this);\n};\n" + code + "\nreturn logged;")
        browser.get(f"{first.base_url}/health")
        browser.execute_script("""window.result = null;
            const [url, body] = arguments;
            import(url).then((m) => (new Function("m", "return (async () => {" + body + "})();"))(m))
              .then((value) => { window.result = { value }; }, (err) => { window.result = { error: String(err.stack || err) }; });""",
                               f"{first.base_url}/static/wm-refiner.js", body)
        wait_until(lambda: browser.execute_script("return window.flushing || window.result"), "the page's flush")
        drain = httpx.post(f"{first.base_url}/v1/admin/drain", timeout=DEADLINE_S)
        assert drain.status_code == 200 and drain.json()["sessions_saved"] == 1, drain.text
        browser.execute_script("window.drained()")
        assert first.terminate() in (0, -15), first.log()  # a drained server may exit by the signal itself
    finally:
        first.kill()
    second = server()
    try:
        result = wait_until(lambda: browser.execute_script("return window.result"), "the page to finish")
    finally:
        second.kill()
    assert "error" not in result, result["error"]
    logged = result["value"]
    assert logged[-1] == ["done"]
    # The drain's cut, as the loop met it (the close, or the flush refused on the closed stream), then the retries
    # while the server drained, stopped and started.
    assert ["closed", 1012] in logged or ["retrying after", "closed"] in logged, logged
    assert {"draining", "unreachable", "not_ready"} & {entry[1] for entry in logged if entry[0] == "retrying after"}
    units = [entry[1:] for entry in logged if entry[0] == "unit"]
    assert units[0][0] == 0 and units[-1][1] == 11
    assert all(end == start for (_, end), (start, _) in zip(units, units[1:])), units  # each frame once, in order


# Runs in the page: a watch of session args[0] on a server still warming up, whose refusal's HTTP questions wait
# until the test has let the server become ready (as when a restarted server's warm-up ends between the refused
# handshake and the questions); then the same watch again.
REFUSED_WHILE_STARTING = """
const client = new m.RefinerClient(location.origin), json = client.json;
const answer = new Promise((resolve) => { window.answer = resolve; });
client.json = async function (...call) { window.asking = true; await answer; return json.apply(this, call); };
const first = client.watch(args[0]);
const refusal = await first.opened.then(() => null, (err) => [err.name, err.status, err.code, err.detail]);
client.json = json;
const again = client.watch(args[0]);
const opened = await again.opened.then(() => "opened", (err) => String(err));
again.close();
return { refusal, opened };
"""


def test_a_handshake_refused_while_the_server_started_is_not_ready_though_it_is_ready_when_asked(
        make_settings, tmp_path, browser):
    """A page sees a refused handshake only as 1006 and asks over HTTP why; a restarted server that refused the
    handshake as not ready (503 not_ready) may be ready when asked, and the session answer: the refusal is then
    503 not_ready (what the restart example retries), not `handshake_refused` (a refusal the page stops on), from
    /ready's `ready_for_s` against when the handshake went out. The next watch opens. (It made the restart example
    fail now and then.)"""
    settings = make_settings(snapshot_dir=tmp_path / "snapshots")
    with LiveServer(settings) as first:
        session = httpx.post(f"{first.base_url}/v1/sessions", json={}).json()["session_id"]
    release = threading.Event()
    second = LiveServer(settings)
    second.services.warmup_gate = lambda: release.wait(DEADLINE_S)  # the warm-up holds until the test says
    second.thread.start()
    try:
        wait_until(lambda: second.server.started, "the second server to listen")
        assert httpx.get(f"{second.base_url}/ready").status_code == 503
        browser.get(f"{second.base_url}/health")
        browser.execute_script("""window.result = null;
            const [url, body, id] = arguments;
            import(url).then((m) => (new Function("m", "args", "return (async () => {" + body + "})();"))(m, [id]))
              .then((value) => { window.result = { value }; }, (err) => { window.result = { error: String(err.stack || err) }; });""",
                               f"{second.base_url}/static/wm-refiner.js", REFUSED_WHILE_STARTING, session)
        wait_until(lambda: browser.execute_script("return window.asking || window.result"), "the refusal's questions")
        release.set()
        wait_until(lambda: httpx.get(f"{second.base_url}/ready").status_code == 200, "the warm-up to end")
        browser.execute_script("window.answer()")
        result = wait_until(lambda: browser.execute_script("return window.result"), "the page to finish")
    finally:
        release.set()
        second.stop()
    assert "error" not in result, result["error"]
    name, status, code, detail = result["value"]["refusal"]
    assert (name, status, code) == ("RefinerError", 503, "not_ready"), detail
    assert "became ready" in detail and "open it again" in detail
    assert result["value"]["opened"] == "opened"


# Runs in the page: a stream whose messages carry the prompt only when it changes, written the way JavaScript (and the
# TypeScript declarations' optional fields) invite: `prompt_embeds: switching ? prompt : undefined`.
OPTIONAL_PROMPT = """
const client = new m.RefinerClient(args[0]), { session_id } = await client.createSession({ block_size: 3 });
const latents = (t) => m.Tensor.from("F32", [1, 128, t, 4, 4], new Float32Array(128 * t * 16).map(Math.random));
const prompts = [1, 2].map(() => m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32).map(Math.random)));
const clip = latents(10), out = { events: [], units: [] };
const chunk = (at, prompt) => ({ latents: clip.slice(2, at, at + 2), prompt_embeds: prompt, prompt_attention_mask: undefined });
const plain = clip.slice(2, 0, 2);
out.sameBytes = b64.encode(m.encodeSafetensors({ latents: plain, prompt_embeds: undefined })) ===
                b64.encode(m.encodeSafetensors({ latents: plain }));
try { m.encodeSafetensors({ latents: plain, prompt_embeds: null }); out.nullRefused = null; } catch (err) { out.nullRefused = err.message; }
const stream = client.stream(session_id);
for (let at = 0; at < 10; at += 2) await stream.send(chunk(at, at === 0 ? prompts[0] : at === 6 ? prompts[1] : undefined));
await stream.flush();
for await (const message of stream) {
  if (message.type === "unit") out.units.push([message.frameStart, message.frameEnd]); else out.events.push(message);
}
return out;
"""


def test_a_chunk_whose_optional_tensors_are_undefined_is_sent_without_them(make_settings, browser):
    """`{latents, prompt_embeds: undefined}` (the prompt switched only on some messages) is encoded as `{latents}`
    and streamed; it threw "prompt_embeds is not a Tensor", though the declarations make the field optional. A null
    is still refused, saying what to give."""
    with LiveServer(make_settings()) as server:
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, OPTIONAL_PROMPT, server.base_url)
    assert out["sameBytes"] is True
    assert out["nullRefused"] and "prompt_embeds is not a Tensor" in out["nullRefused"]
    assert out["units"] == [[0, 1], [1, 4], [4, 7], [7, 10]] and out["events"] == [{"type": "done", "frames": 10}]


# Runs in the page: a client per spelling of the right key with whitespace around it (read from a file, pasted), each
# creating a session, streaming one frame and watching it.
PADDED_KEYS = """
const [base, key] = args, out = {};
const latents = m.Tensor.from("F32", [1, 128, 1, 4, 4], new Float32Array(128 * 16));
const prompt = m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32));
for (const padded of [key + "\\n", " " + key, "\\t" + key + "\\r\\n"]) {
  const client = new m.RefinerClient(base, { apiKey: padded }), got = out[JSON.stringify(padded)] = [];
  try {
    const { session_id } = await client.createSession({});
    got.push("created");
    const watcher = client.watch(session_id), stream = client.stream(session_id);
    await watcher.opened; got.push("watching");
    await stream.send({ latents, prompt_embeds: prompt });
    got.push((await stream.receive()).frameEnd, (await watcher.receive()).frameEnd);
    stream.close(); watcher.close();
  } catch (err) { got.push(err.code, err.detail); }
}
return out;
"""


def test_a_key_with_whitespace_around_it_opens_websockets_as_it_calls_http(make_settings, browser):
    """A key read from a file ("KEY\\n") or pasted with a space: the browser strips that whitespace from the
    Authorization header (Fetch normalizes header values), so HTTP worked, but the module sent it whole in the
    WebSocket subprotocol, and every stream and watcher was refused with a misleading handshake_refused (naming
    cors_origins). The module sends the key the same way on both."""
    with LiveServer(make_settings(api_key=KEY)) as server:
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, PADDED_KEYS, server.base_url, KEY)
    assert out == {json.dumps(padded): ["created", "watching", 1, 1]
                   for padded in (KEY + "\n", " " + KEY, "\t" + KEY + "\r\n")}, out


# Runs in the page: a stream that reads one unit, then (once args[1] resolves: another connection took the session over)
# reads to its end and calls reconnect(), as the restart example's loop does after any close.
TAKEN_OVER = """
const client = new m.RefinerClient(args[0]), { session_id } = await client.createSession({ block_size: 3 });
const latents = m.Tensor.from("F32", [1, 128, 5, 4, 4], new Float32Array(128 * 5 * 16).map(Math.random));
const stream = client.stream(session_id);
await stream.send({ latents, prompt_embeds: m.Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32)) });
const out = { session_id, first: (await stream.receive()).frameEnd };
window.takenOver = new Promise((resolve) => { window.tookOver = resolve; });
window.sessionId = session_id;
await window.takenOver;
for await (const message of stream) {}
out.close = [stream.closeEvent.code, stream.closeEvent.reason];
try { const again = stream.reconnect(); await again.opened; out.reconnected = true; } catch (err) { out.refused = [err.name, err.code, err.detail]; }
return out;
"""


def test_a_stream_another_connection_took_over_is_not_taken_back_by_reconnect(make_settings, browser):
    """Two tabs (or two clients) resuming the same session take it from each other: each closes the other with 1008
    "another connection resumed this session". A loop that reconnects after every close (the restart example's)
    took it straight back, and two such loops took turns forever. reconnect() after a 1008 (a takeover, or a resume
    the server refused) throws instead, saying why; the other connection keeps the session."""
    import json as json_module

    from websockets.sync.client import connect

    with LiveServer(make_settings()) as server:
        browser.get(f"{server.base_url}/health")
        browser.set_script_timeout(DEADLINE_S)
        browser.execute_script("""window.result = null;
            import(arguments[0]).then((m) => (new Function("m", "args", "return (async () => {" + arguments[1] + "})();"))(m, [arguments[2]]))
              .then((value) => { window.result = { value }; }, (err) => { window.result = { error: String(err.stack || err) }; });""",
                               f"{server.base_url}/static/wm-refiner.js", TAKEN_OVER, server.base_url)
        session_id = wait_until(lambda: browser.execute_script("return window.sessionId"), "the page's first unit")
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream?resume_from=1", max_size=None) as other:
            event = json_module.loads(other.recv())
            assert event["type"] == "session"
            browser.execute_script("window.tookOver()")
            result = wait_until(lambda: browser.execute_script("return window.result"), "the page to finish")
            other.send(json_module.dumps({"type": "flush"}))  # the session is still this connection's
            messages = [message for message in other]
        assert json_module.loads(messages[-1]) == {"type": "done", "frames": 5}
    assert "error" not in result, result["error"]
    out = result["value"]
    assert out["close"] == [1008, "another connection resumed this session"]
    assert "reconnected" not in out
    name, code, detail = out["refused"]
    assert (name, code) == ("RefinerError", "not_reconnectable")
    assert "another connection resumed this session" in detail and "resumeFrom" in detail


WATCH_RESUMED = """
const [base, sessionId] = args;
const client = new m.RefinerClient(base);
const watcher = client.watch(sessionId, { resumeFrom: 2 });
await watcher.opened;
const out = { units: [], events: [] };
for await (const message of watcher) {
  if (message.type === "unit") out.units.push([message.frameStart, message.frameEnd, b64.encode(new Uint8Array(message.bytes))]);
  else out.events.push(message);
}
out.closeCode = watcher.closeEvent.code;
return out;
"""


def test_a_watch_with_resume_from_gets_the_kept_units_again(make_settings, browser):
    """``client.watch(id, {resumeFrom})`` asks ``?resume_from=``: the units the session kept from there (the one
    straddling it whole), byte for byte what its stream got, each block's event, then done."""
    from websockets.sync.client import connect

    latents, embeds, mask = make_clip(frames=8, seed=31)
    with LiveServer(make_settings()) as server:
        session_id = httpx.post(f"{server.base_url}/v1/sessions", timeout=DEADLINE_S).json()["session_id"]
        produced = []
        with connect(f"{server.ws_url}/v1/sessions/{session_id}/stream", open_timeout=DEADLINE_S,
                     max_size=None) as ws:
            ws.send(payload(latents, embeds, mask))
            ws.send('{"type": "flush"}')
            while isinstance(message := ws.recv(timeout=DEADLINE_S), bytes):
                produced.append(message)
        browser.get(f"{server.base_url}/health")
        out = run_js(browser, WATCH_RESUMED, server.base_url, session_id)
    assert [(start, end) for start, end, _ in out["units"]] == [(1, 4), (4, 7), (7, 8)]
    assert [base64.b64decode(data) for _, _, data in out["units"]] == produced[1:]
    blocks = [(e["frame_start"], e["frame_end"]) for e in out["events"] if e["type"] == "block"]
    assert blocks == [(1, 4), (4, 7), (7, 8)]
    assert out["events"][-1] == {"type": "done", "frames": 8} and out["closeCode"] == 1000
