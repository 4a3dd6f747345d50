// wm-refiner.js: the wm-refiner wire protocol for browsers, one dependency-free ES module (no build step).
//
//   import { RefinerClient, Tensor } from "/static/wm-refiner.js";
//
// What it covers (docs/api.md, "The JavaScript module"): safetensors encode/decode, the HTTP routes (info, sessions,
// chunks with `seq` retries, one-shot refine), the WebSocket stream with its `?resume_from=N` reattach, and watchers.
// The server serves it at GET /static/wm-refiner.js without a key, like /view, which imports it.
//
// Decisions:
// - A tensor is a `Tensor` (dtype, shape, little-endian bytes). Decoding never copies the payload: `bytes` is a view
//   into the message, `data` a typed array (copied once only when the view is not aligned for its element size).
// - F16 and BF16 have no typed array everywhere yet: their `data` is the raw bits as a Uint16Array, `toFloat32()`
//   converts, and `Tensor.from` rounds float32 values to them (round to nearest, ties to even, like torch).
// - Sockets are async iterators of messages: a unit (`{type: "unit", tensors, metadata, frameStart, frameEnd, seq, latencyMs}`)
//   or the server's JSON event as sent (`{type: "block" | "done" | "error" | "session" | "dropped", ...}`). A binary
//   message that is not safetensors arrives as `{type: "error", error: {code: "unreadable_unit", ...}}`, so one loop
//   handles both kinds of failure and goes on.

export const SUBPROTOCOL = "wm-refiner";
export const BEARER_PREFIX = "wm-refiner.bearer.";

// --- safetensors -------------------------------------------------------------------------------------------------
// Each dtype this API reads or writes: its bytes per element and the typed array that holds its elements.
export const DTYPES = Object.freeze({
  F32: { size: 4, array: Float32Array },
  F16: { size: 2, array: Uint16Array },   // raw IEEE half bits
  BF16: { size: 2, array: Uint16Array },  // raw bfloat16 bits (the high half of a float32)
  I64: { size: 8, array: BigInt64Array },
  I32: { size: 4, array: Int32Array },
  U8: { size: 1, array: Uint8Array },
  BOOL: { size: 1, array: Uint8Array },   // one byte per element, 0 or 1
});
const MAX_HEADER_BYTES = 100 << 20;  // safetensors' own bound: a header length past it is not a safetensors file

if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) {
  // Typed arrays use the platform's byte order; the wire is little-endian (every browser platform is).
  throw new Error("wm-refiner.js needs a little-endian platform");
}

function checkDtype(dtype) {
  if (!Object.hasOwn(DTYPES, dtype)) {
    throw new TypeError(`unsupported dtype ${JSON.stringify(dtype)}: use one of ${Object.keys(DTYPES).join(", ")}`);
  }
  return DTYPES[dtype];
}
function checkShape(shape) {
  if (!Array.isArray(shape) || !shape.every((n) => Number.isSafeInteger(n) && n >= 0)) {
    throw new TypeError(`a shape is an array of non-negative integers, not ${JSON.stringify(shape)}`);
  }
  return shape.reduce((a, b) => a * b, 1);
}

// float32 <-> half and bfloat16, bit by bit (no Float16Array needed).
const f32 = new Float32Array(1), u32 = new Uint32Array(f32.buffer);
export function float32ToBF16Bits(value) {
  f32[0] = value;
  const bits = u32[0];
  if ((bits & 0x7fffffff) > 0x7f800000) return ((bits >>> 16) | 0x40) & 0xffff;  // NaN stays a (quiet) NaN
  return ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;  // round to nearest, ties to even
}
export function bf16BitsToFloat32(bits) {
  u32[0] = bits << 16;
  return f32[0];
}
export function float32ToF16Bits(value) {
  f32[0] = value;
  const bits = u32[0], sign = (bits >>> 16) & 0x8000, exponent = (bits >>> 23) & 0xff, mantissa = bits & 0x7fffff;
  if (exponent === 0xff) return sign | 0x7c00 | (mantissa ? 0x200 : 0);  // inf, or a quiet NaN
  const e = exponent - 127 + 15;  // the half's biased exponent
  if (e >= 0x1f) return sign | 0x7c00;  // too large: inf
  if (e <= 0) {  // a half subnormal (or zero): shift the mantissa with its implicit 1 into place, round to even
    if (e < -10) return sign;
    const full = mantissa | 0x800000, shift = 14 - e, half = 1 << (shift - 1);
    let result = full >>> shift;
    const rest = full & ((1 << shift) - 1);
    if (rest > half || (rest === half && (result & 1))) result += 1;
    return sign | result;
  }
  let result = (e << 10) | (mantissa >>> 13);
  const rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (result & 1))) result += 1;  // may carry into the exponent: still right
  return sign | result;
}
export function f16BitsToFloat32(bits) {
  const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >>> 10) & 0x1f, mantissa = bits & 0x3ff;
  if (exponent === 0) return sign * mantissa * 2 ** -24;
  if (exponent === 0x1f) return mantissa ? NaN : sign * Infinity;
  return sign * (1 + mantissa / 1024) * 2 ** (exponent - 15);
}

/** A tensor: its dtype, shape and row-major little-endian bytes. */
export class Tensor {
  constructor(dtype, shape, bytes) {
    const { size } = checkDtype(dtype), count = checkShape(shape);
    if (!(bytes instanceof Uint8Array)) throw new TypeError("Tensor bytes are a Uint8Array; use Tensor.from for values");
    if (bytes.byteLength !== count * size) {
      throw new RangeError(`${dtype} ${JSON.stringify(shape)} needs ${count * size} bytes, got ${bytes.byteLength}`);
    }
    this.dtype = dtype; this.shape = shape.slice(); this.bytes = bytes;
  }

  /** A tensor from values: a typed array of the dtype's kind (used as is) or any array-like of numbers
   * (BigInts for I64 welcome; F16/BF16 round float values; BOOL takes true/false or 0/1). */
  static from(dtype, shape, values) {
    const { array } = checkDtype(dtype), count = checkShape(shape);
    let data;
    if (values instanceof array && !((dtype === "F16" || dtype === "BF16") && !(values instanceof Uint16Array))) {
      data = values;  // already the storage type (F16/BF16: raw bits in a Uint16Array)
    } else {
      const input = Array.from(values);
      if (dtype === "F16") data = Uint16Array.from(input, float32ToF16Bits);
      else if (dtype === "BF16") data = Uint16Array.from(input, float32ToBF16Bits);
      else if (dtype === "I64") data = BigInt64Array.from(input, (v) => BigInt(v));
      else if (dtype === "BOOL") data = Uint8Array.from(input, (v) => (v ? 1 : 0));
      else data = array.from(input, Number);
    }
    if (data.length !== count) {
      throw new RangeError(`${dtype} ${JSON.stringify(shape)} holds ${count} values, got ${data.length}`);
    }
    return new Tensor(dtype, shape, new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
  }

  /** The elements as the dtype's typed array (F16/BF16: raw bits); a copy only when `bytes` is unaligned. */
  get data() {
    const { size, array } = DTYPES[this.dtype];
    const aligned = this.bytes.byteOffset % size === 0 ? this.bytes : this.bytes.slice();
    return new array(aligned.buffer, aligned.byteOffset, aligned.byteLength / size);
  }

  /** Indices [start, end) of one axis, as a new tensor (a copy): `clip.slice(2, t, t + 3)` is frames [t, t + 3) of
   * latents (B, C, T, H, W), torch's `clip[:, :, t:t + 3]`, the way to send a clip fetched or built whole in chunks.
   * `end` past the axis stops at its end, as Python's slices do. */
  slice(axis, start, end = this.shape[axis]) {
    const rank = this.shape.length;
    if (!Number.isInteger(axis) || axis < 0 || axis >= rank) {
      throw new RangeError(`axis ${axis} of a ${rank}-d tensor ${JSON.stringify(this.shape)}: give 0 to ${rank - 1}`);
    }
    end = Math.min(end, this.shape[axis]);
    if (!Number.isInteger(start) || !Number.isInteger(end) || start < 0 || start > end) {
      throw new RangeError(`slice [${start}, ${end}) of axis ${axis} (size ${this.shape[axis]}): give integers 0 <= start <= end`);
    }
    const { size } = DTYPES[this.dtype], outer = this.shape.slice(0, axis).reduce((a, b) => a * b, 1);
    const inner = this.shape.slice(axis + 1).reduce((a, b) => a * b, 1) * size;
    const run = (end - start) * inner, stride = this.shape[axis] * inner, out = new Uint8Array(outer * run);
    for (let o = 0; o < outer; o++) out.set(this.bytes.subarray(o * stride + start * inner, o * stride + end * inner), o * run);
    const shape = this.shape.slice();
    shape[axis] = end - start;
    return new Tensor(this.dtype, shape, out);
  }

  /** The elements as float32 (I64 through Number: exact below 2**53). */
  toFloat32() {
    const data = this.data;
    if (this.dtype === "F16") return Float32Array.from(data, f16BitsToFloat32);
    if (this.dtype === "BF16") return Float32Array.from(data, bf16BitsToFloat32);
    if (this.dtype === "I64") return Float32Array.from(data, Number);
    return Float32Array.from(data);
  }
}

/** Tensors (name -> Tensor) and string metadata into one safetensors file (a Uint8Array). The header is padded
 * with spaces to a multiple of 8 bytes, as safetensors' own writer does, so every tensor's data is aligned. A name
 * whose value is undefined is left out, as JSON.stringify leaves it out: `{latents, prompt_embeds: switching ? prompt
 * : undefined}` sends the prompt only when it switches (null is still refused: not a Tensor). */
export function encodeSafetensors(tensors, metadata = null) {
  if (tensors instanceof Tensor) throw new TypeError("encodeSafetensors takes {name: Tensor}, e.g. {latents: tensor}, not a bare Tensor");
  const header = {}, parts = [];
  let offset = 0;
  if (metadata) {
    for (const [key, value] of Object.entries(metadata)) {
      if (typeof value !== "string") throw new TypeError(`metadata values are strings; ${key} is ${typeof value}`);
    }
    header.__metadata__ = metadata;
  }
  for (const [name, tensor] of Object.entries(tensors)) {
    if (tensor === undefined) continue;
    if (!(tensor instanceof Tensor)) throw new TypeError(`${name} is not a Tensor: build it with Tensor.from(dtype, shape, values)`);
    if (name === "__metadata__") throw new TypeError("__metadata__ is the header's metadata, not a tensor name");
    header[name] = { dtype: tensor.dtype, shape: tensor.shape, data_offsets: [offset, offset + tensor.bytes.byteLength] };
    parts.push(tensor.bytes);
    offset += tensor.bytes.byteLength;
  }
  const json = new TextEncoder().encode(JSON.stringify(header));
  const padded = Math.ceil((8 + json.length) / 8) * 8 - 8;
  const out = new Uint8Array(8 + padded + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.set(json, 8);
  out.fill(0x20, 8 + json.length, 8 + padded);
  let at = 8 + padded;
  for (const part of parts) { out.set(part, at); at += part.byteLength; }
  return out;
}

/** One safetensors file (ArrayBuffer, or a Uint8Array view of one) into `{tensors: {name: Tensor}, metadata}`; the
 * tensors' bytes are views into the input, not copies. Throws a SafetensorsError saying what is wrong. */
export class SafetensorsError extends Error {
  constructor(message) { super(message); this.name = "SafetensorsError"; }
}
export function decodeSafetensors(input) {
  const buffer = input instanceof ArrayBuffer ? new Uint8Array(input) : input;
  if (!(buffer instanceof Uint8Array)) throw new TypeError("decodeSafetensors takes an ArrayBuffer or a Uint8Array");
  if (buffer.byteLength < 8) throw new SafetensorsError(`${buffer.byteLength} bytes: a safetensors file starts with an 8-byte header length`);
  const length = new DataView(buffer.buffer, buffer.byteOffset, 8).getBigUint64(0, true);
  if (length > BigInt(Math.min(MAX_HEADER_BYTES, buffer.byteLength - 8))) {
    throw new SafetensorsError(`header length ${length} exceeds the ${buffer.byteLength - 8} bytes that follow: not a safetensors file`);
  }
  const headerLength = Number(length);
  let header;
  try {
    header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(buffer.subarray(8, 8 + headerLength)));
  } catch (err) {
    throw new SafetensorsError("the header is not UTF-8 JSON: " + err.message);
  }
  if (!header || typeof header !== "object" || Array.isArray(header)) throw new SafetensorsError("the header is not a JSON object");
  const data = buffer.subarray(8 + headerLength), tensors = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const [begin, end] = (info && info.data_offsets) || [];
    if (!(Number.isSafeInteger(begin) && Number.isSafeInteger(end) && 0 <= begin && begin <= end && end <= data.byteLength)) {
      throw new SafetensorsError(`${name}: data_offsets ${JSON.stringify(info && info.data_offsets)} are outside the ${data.byteLength} data bytes`);
    }
    try {
      tensors[name] = new Tensor(info.dtype, info.shape, data.subarray(begin, end));
    } catch (err) {
      throw new SafetensorsError(`${name}: ${err.message}`);
    }
  }
  return { tensors, metadata: header.__metadata__ || {} };
}

// --- HTTP --------------------------------------------------------------------------------------------------------
/** An error answer: `status` (HTTP), `code` and `detail` (the message) from the server's `{"error": {...}}`,
 * `retryAfter` (s), and `body`: the answer's JSON as sent, for the fields some errors carry besides code and message
 * (`insufficient_memory`'s `bytes_needed`, `over_capacity`'s `load_needed`...; docs/api.md "Errors"). A request that
 * got no answer at all is one too, `status` 0 and code `unreachable` (`cause`: the browser's TypeError), since a page
 * cannot tell a server that is down from one that refuses its origin. */
export class RefinerError extends Error {
  constructor(status, code, message, retryAfter = null, { body = null, cause } = {}) {
    super(`${status} ${code}: ${message}`, cause === undefined ? undefined : { cause });
    this.name = "RefinerError";  // what a console or a stack shows before the message
    this.status = status; this.code = code; this.detail = message; this.retryAfter = retryAfter; this.body = body;
  }
}

/** A key as the WebSocket subprotocol carries it: base64url of its UTF-8 bytes, without padding. */
export function base64url(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

// The key as it goes out: without the HTTP whitespace (space, tab, CR, LF) around it, which Fetch strips from every
// header value. A key read from a file ("KEY\n") or pasted with a space then works on the WebSockets too, whose
// subprotocol would otherwise carry the whitespace the Authorization header lost, and be refused.
const sentKey = (key) => String(key || "").replace(/^[\t\n\r ]+|[\t\n\r ]+$/g, "");
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const body = (payload) => (payload instanceof Uint8Array || payload instanceof ArrayBuffer ? payload : encodeSafetensors(payload));

/** `baseUrl` as an absolute http(s) URL without a trailing slash: given absolute, or as a path on this page's origin
 * (a same-origin proxy: "/refiner"). Anything else would send HTTP to the page's own server ("127.0.0.1:8000" is a
 * relative path) or nowhere ("localhost:8000" is a URL of scheme "localhost"), and WebSockets to a mangled host, so
 * it is a TypeError saying what to give. */
function serverUrl(baseUrl) {
  const text = String(baseUrl), page = globalThis.location ? globalThis.location.href : undefined;
  let url = null;
  if (/^[a-z][a-z0-9+.-]*:\/\//i.test(text) || (page && text.startsWith("/"))) {
    try { url = new URL(text, page); } catch (err) { url = null; }
  }
  if (!url || (url.protocol !== "http:" && url.protocol !== "https:")) {
    throw new TypeError(`RefinerClient takes the server's http:// or https:// URL, e.g. "http://127.0.0.1:8000" (or a ` +
                        `path on this page's origin, "/refiner"), not ${JSON.stringify(text)}; it derives the ws:// ` +
                        "URLs itself");
  }
  return url.href.replace(/\/+$/, "");
}

/** The service at `baseUrl` (default: this page's origin). `apiKey` is sent as `Authorization: Bearer` and, on
 * WebSockets (which take no headers in a browser), as the `wm-refiner.bearer.<base64url key>` subprotocol, both without
 * the whitespace around it; it may be changed at any time (`client.apiKey = ...`). */
export class RefinerClient {
  constructor(baseUrl = globalThis.location ? globalThis.location.origin : undefined, { apiKey = "" } = {}) {
    if (!baseUrl) throw new TypeError("RefinerClient needs the server's URL, e.g. new RefinerClient(\"http://127.0.0.1:8000\")");
    this.baseUrl = serverUrl(baseUrl);
    this.apiKey = apiKey;
  }

  /** One HTTP request; resolves to the Response when it is 2xx, else throws a RefinerError. */
  async request(method, path, { json, payload, query } = {}) {
    const key = sentKey(this.apiKey), headers = key ? { Authorization: "Bearer " + key } : {};
    let sent;
    if (json !== undefined) { headers["Content-Type"] = "application/json"; sent = JSON.stringify(json); }
    if (payload !== undefined) { headers["Content-Type"] = "application/octet-stream"; sent = body(payload); }
    const url = this.baseUrl + path + queryString(query);
    let response;
    try {
      response = await fetch(url, { method, headers, body: sent });
    } catch (err) {
      if (!(err instanceof TypeError)) throw err;
      throw new RefinerError(0, "unreachable", `${method} ${url} got no answer (${err.message}): the server is down ` +
        `or restarting, the URL is wrong, or the server does not list this page's origin ` +
        `${globalThis.location ? globalThis.location.origin : ""} in cors_origins (the browser's console says which)`,
        null, { cause: err });
    }
    if (!response.ok) {
      const reply = await response.json().catch(() => null), error = reply && reply.error;
      const retryAfter = response.headers.get("Retry-After");
      throw new RefinerError(response.status, error ? error.code : "http_error", error ? error.message : response.statusText,
                             retryAfter === null ? null : Number(retryAfter), { body: reply });
    }
    return response;
  }
  async json(method, path, options) { return (await this.request(method, path, options)).json(); }

  info() { return this.json("GET", "/v1/info"); }
  /** One page of the live sessions: `{sessions, next}`; pass `after: next` for the following page. */
  listSessions({ limit, after } = {}) { return this.json("GET", "/v1/sessions", { query: { limit, after } }); }
  /** `{session_id, config}`; with `id`, created under that name (PUT: repeating it with the same config is safe). */
  createSession(config = {}, { id } = {}) {
    return id === undefined ? this.json("POST", "/v1/sessions", { json: config })
      : this.json("PUT", "/v1/sessions/" + encodeURIComponent(id), { json: config });
  }
  getSession(id) { return this.json("GET", "/v1/sessions/" + encodeURIComponent(id)); }
  async deleteSession(id) { await this.request("DELETE", "/v1/sessions/" + encodeURIComponent(id)); }

  /** Sends one chunk (`{latents, prompt_embeds?, prompt_attention_mask?}` as Tensors, or encoded bytes) and
   * resolves to the unit it finalized: `{tensors, metadata, frameStart, frameEnd, seq, latencyMs, replayed}`.
   * `payload` null with `flush: true` flushes without new frames (an empty body).
   *
   * With `seq` the call is safe to retry, and it does so itself up to `retries` times, with the same seq and the same
   * bytes: when the request failed on the network (the server may have taken the chunk and lost the answer:
   * repeating the last accepted seq's request returns the stored answer, `replayed: true`) or answered 503 with
   * Retry-After (nothing was taken). Without `seq` nothing is retried (a repeat would append the frames twice). A 409
   * seq_conflict names the seq the server expects; other frames or another `flush` under the last accepted seq get
   * it too (not a retry: nothing was taken). */
  async sendChunk(id, payload, { seq, flush = false, retries = 3, maxWaitMs = 10000 } = {}) {
    if (payload == null && !flush) {
      throw new TypeError("sendChunk needs the chunk's tensors ({latents, ...}) or its encoded bytes; null (no new " +
                          "frames) only with flush: true");
    }
    const bytes = payload == null ? new Uint8Array(0) : body(payload);
    const path = `/v1/sessions/${encodeURIComponent(id)}/chunks`;
    for (let attempt = 0; ; attempt++) {
      try {
        const response = await this.request("POST", path, { payload: bytes, query: { seq, flush } });
        return { ...readUnit(await response.arrayBuffer()), replayed: response.headers.get("X-Replayed") === "true" };
      } catch (err) {
        const retriable = seq !== undefined && attempt < retries &&
          err instanceof RefinerError && (err.code === "unreachable" || (err.status === 503 && err.retryAfter !== null));
        if (!retriable) throw err;
        await sleep(Math.min(maxWaitMs, err.retryAfter !== null ? err.retryAfter * 1000 : 200 * 2 ** attempt));
      }
    }
  }

  /** One shot: a whole clip in, the refined clip out (`params`: the session config as query parameters). */
  async refine(payload, params = {}) {
    const response = await this.request("POST", "/v1/refine", { payload: body(payload), query: params });
    return readUnit(await response.arrayBuffer());
  }

  /** The session's stream (WS /v1/sessions/{id}/stream); `resumeFrom: N` reattaches after a lost connection. */
  stream(id, { resumeFrom } = {}) {
    return new RefinerStream(this.wsUrl(`/v1/sessions/${encodeURIComponent(id)}/stream`, { resume_from: resumeFrom }),
                             this.subprotocols(), this, id,
                             (event, sentAt) => this.handshakeRefusal(id, event, { stream: true, resumeFrom, sentAt }));
  }
  /** A read-only watcher (WS /v1/sessions/{id}/watch): every unit the session finalizes from now on. */
  watch(id, { outputs, videoFormat, videoQuality, resumeFrom } = {}) {
    const query = { outputs: Array.isArray(outputs) ? outputs.join(",") : outputs, video_format: videoFormat,
                    video_quality: videoQuality, resume_from: resumeFrom };
    return new MessageSocket(this.wsUrl(`/v1/sessions/${encodeURIComponent(id)}/watch`, query), this.subprotocols(),
                             (event, sentAt) => this.handshakeRefusal(id, event, { sentAt }));
  }

  /** Why a WebSocket to session `id` closed before it opened, as a RefinerError. A browser hides a refused
   * handshake's status and body from the page (it sees close code 1006, the console the status), so this asks the
   * same question over HTTP: GET /v1/sessions/{id}, with the same key, gives the refusals a watch or stream shares
   * with it (401 unauthorized, 404 session_not_found, 410 session_evicted, unreachable), GET /ready those of a
   * server starting or draining (503 not_ready, draining: a draining server still answers reads); a session that
   * answers flushed or streaming explains a stream refused without `resumeFrom` (409 stream_closed,
   * stream_in_use). A server that became ready after the handshake went out (`sentAt`, `performance.now()`; /ready's
   * `ready_for_s`) was most likely starting when it refused it: 503 `not_ready`, which a retry gets past (the
   * questions come too late to see it: a restarted server warms up between the two). Anything else is
   * `handshake_refused`, listing what is left. */
  async handshakeRefusal(id, event, { stream = false, resumeFrom, sentAt } = {}) {
    const what = `the WebSocket to session ${id} closed before it opened (code ${event.code}: how a browser shows a ` +
      "refused handshake)";
    let state, ready;
    for (const path of ["/v1/sessions/" + encodeURIComponent(id), "/ready"]) {
      try {
        const answer = await this.json("GET", path);
        if (!state) state = answer; else ready = answer;
      } catch (err) {
        if (!(err instanceof RefinerError)) throw err;
        return new RefinerError(err.status, err.code, `${what}; GET ${path} says: ${err.detail}`, err.retryAfter,
                                { body: err.body, cause: err });
      }
    }
    if (stream && resumeFrom === undefined && state.flushed) {
      return new RefinerError(409, "stream_closed", `${what}: the session was flushed and takes no more frames; ` +
        "reconnect with resumeFrom (the frames you received) to get the units you missed, or create a new session");
    }
    if (stream && resumeFrom === undefined && state.streaming) {
      return new RefinerError(409, "stream_in_use", `${what}: the session already has an open stream; close it ` +
        "before opening another, or reconnect with resumeFrom to take the session over");
    }
    const since = sentAt === undefined ? 0 : (performance.now() - sentAt) / 1000;
    if (ready && typeof ready.ready_for_s === "number" && ready.ready_for_s <= since) {
      return new RefinerError(503, "not_ready", `${what}: the server became ready ${ready.ready_for_s} s ago, after ` +
        `this handshake went out ${since.toFixed(3)} s ago, so it was most likely refused as not ready yet (503 ` +
        "not_ready); open it again", 0);
    }
    return new RefinerError(0, "handshake_refused", `${what}, though the session answers over HTTP with this key: ` +
      "this page's origin may not be in the server's cors_origins (403 origin_not_allowed), the watch may be past " +
      "max_watchers or max_watch_encodings (503 over_capacity), or a query value refused (422 invalid_request); " +
      "the browser's console shows the status");
  }

  wsUrl(path, query) {
    const url = new URL(this.baseUrl + path + queryString(query));
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    return url.href;
  }
  subprotocols() {
    const key = sentKey(this.apiKey);
    return key ? [SUBPROTOCOL, BEARER_PREFIX + base64url(key)] : [SUBPROTOCOL];
  }
}

function queryString(query) {
  const entries = Object.entries(query || {}).filter(([, value]) => value !== undefined && value !== null);
  return entries.length ? "?" + new URLSearchParams(entries.map(([k, v]) => [k, String(v)])).toString() : "";
}

/** A unit's bytes as `{type: "unit", tensors, metadata, frameStart, frameEnd, seq, latencyMs, bytes}` (frames:
 * latent indices; `seq`: the chunk that finalized it; `latencyMs`: the server's time for it, api.md; each null when
 * the metadata lacks it). */
export function readUnit(buffer) {
  const { tensors, metadata } = decodeSafetensors(buffer);
  const number = (key) => (metadata[key] === undefined ? null : Number(metadata[key]));
  return { type: "unit", tensors, metadata, frameStart: Number(metadata.frame_start), frameEnd: Number(metadata.frame_end),
           seq: number("seq"), latencyMs: number("latency_ms"), bytes: buffer };
}

// --- WebSockets --------------------------------------------------------------------------------------------------
/** A WebSocket as an async iterator of messages (units and events, see the top of this file); iteration ends when
 * the connection closes. `opened` resolves once the server accepted; if it closed first it rejects with a
 * RefinerError saying why (a refused handshake reaches a page only as close code 1006: the client's sockets ask the
 * server over HTTP, `RefinerClient.handshakeRefusal`). `closed` resolves to the CloseEvent. */
export class MessageSocket {
  constructor(url, protocols, refusal = null) {
    this.queue = []; this.waiters = []; this.closeEvent = null;
    const sentAt = performance.now();  // a refusal's questions compare it with when the server became ready
    const ws = this.ws = new WebSocket(url, protocols);
    ws.binaryType = "arraybuffer";
    // The first close listener, so that whoever handles `opened`'s rejection finds closeEvent set.
    ws.addEventListener("close", (event) => { this.closeEvent = event; this.push(null); });
    this.opened = new Promise((resolve, reject) => {
      let open = false;
      ws.addEventListener("open", () => { open = true; resolve(this); }, { once: true });
      ws.addEventListener("close", (event) => {
        if (open) return;
        const closed = new RefinerError(0, "closed", `the WebSocket closed before it opened (code ${event.code})`);
        if (!refusal) { reject(closed); return; }
        refusal(event, sentAt).then(reject, () => reject(closed));
      }, { once: true });
    });
    this.opened.catch(() => {});  // an unawaited refusal is reported by `closed` and the iterator, not as unhandled
    this.closed = new Promise((resolve) => ws.addEventListener("close", resolve, { once: true }));
    ws.addEventListener("message", (event) => this.push(this.parse(event.data)));
  }
  parse(data) {
    if (typeof data === "string") {
      try { return JSON.parse(data); } catch (err) { return { type: "error", error: { code: "unreadable_event", message: String(err) } }; }
    }
    try { return readUnit(data); } catch (err) {
      return { type: "error", error: { code: "unreadable_unit", message: String(err.message || err) } };
    }
  }
  push(message) {
    if (this.waiters.length) this.waiters.shift()(message); else this.queue.push(message);
  }
  /** The next message, or null once the connection has closed. */
  async receive() {
    if (this.queue.length) { const message = this.queue[0]; if (message !== null) this.queue.shift(); return message; }
    const message = await new Promise((resolve) => this.waiters.push(resolve));
    if (message === null) {  // stays closed: for every later call and every other caller waiting
      this.queue.push(null);
      for (const resolve of this.waiters.splice(0)) resolve(null);
    }
    return message;
  }
  async next() { const value = await this.receive(); return value === null ? { done: true, value: undefined } : { done: false, value }; }
  [Symbol.asyncIterator]() { return this; }
  close(code = 1000, reason = "") { this.ws.close(code, reason); }
}

/** The session's stream: `send` chunks (Tensors or encoded bytes, any split), `flush()`, iterate the units. It counts
 * the frames of the units the page has read (`framesReturned`), so `reconnect()` after a lost connection resumes from
 * there: the new stream's first message is the server's `{type: "session", frames_received, ...}`: resend the clip
 * from `frames_received` on. */
export class RefinerStream extends MessageSocket {
  constructor(url, protocols, client, sessionId, refusal = null) {
    super(url, protocols, refusal);
    this.client = client; this.sessionId = sessionId;
    const resumed = new URL(url).searchParams.get("resume_from");
    this.framesReturned = resumed === null ? 0 : Number(resumed);
  }
  /** Counts a unit's frames as returned once the page has it (not when it arrives: a unit still queued when the
   * connection is lost is sent again after reconnect()). */
  async receive() {
    const message = await super.receive();
    if (message && message.type === "unit") this.framesReturned = Math.max(this.framesReturned, message.frameEnd);
    return message;
  }
  /** Waits for the connection to open, then sends (messages keep their order). Once the connection is closing or
   * closed it sends nothing and throws a RefinerError `closed` (a browser would drop the message with only a
   * console warning, and the page believe it sent): reconnect() and resend from the session event's
   * `frames_received`. */
  async send(payload) { await this.opened; this.transmit(body(payload)); }
  async flush() { await this.opened; this.transmit(JSON.stringify({ type: "flush" })); }
  transmit(data) {
    if (this.ws.readyState !== WebSocket.OPEN) {
      const event = this.closeEvent, how = event ? `closed (code ${event.code}${event.reason ? ": " + event.reason : ""})` : "closing";
      throw new RefinerError(0, "closed", `the stream is ${how}: nothing was sent; reconnect() and resend from the ` +
                             "session event's frames_received");
    }
    this.ws.send(data);
  }
  /** A new connection to the same session, resuming after the last frame this one received. Not after the server
   * closed this one with 1008: another connection resumed the session (a second tab, another client) or the server
   * refused the resume, and reconnecting cannot help (it would take the session back from that connection, whose own
   * reconnect would take it again, for ever); that throws a RefinerError `not_reconnectable` saying why. */
  reconnect() {
    const event = this.closeEvent;
    if (event && event.code === 1008) {
      throw new RefinerError(0, "not_reconnectable", `the server closed this stream with 1008 (${event.reason || "policy"}` +
        "): reconnecting would not help. If another connection (a second tab, another client) now streams the " +
        "session, leave it there; to take it back anyway, or to resume from another frame, open " +
        "client.stream(sessionId, { resumeFrom }) yourself");
    }
    if (this.ws.readyState !== WebSocket.CLOSED) this.close(1000, "reconnecting");
    return this.client.stream(this.sessionId, { resumeFrom: this.framesReturned });
  }
}
