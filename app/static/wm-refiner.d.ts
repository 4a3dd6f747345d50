// wm-refiner.d.ts: the TypeScript declarations of wm-refiner.js (the same folder, GET /static/wm-refiner.d.ts).
//
// Written by hand from the module; tests/app/api/test_js_types.py type-checks a page's code against it with tsc and
// checks that it declares exactly the module's exports and their methods, so the two cannot drift apart.
// How to use it from TypeScript: docs/api.md, "TypeScript". Needs lib "dom" and "es2020" (BigInt64Array) or later.

/** The subprotocol every stream and watcher offers. */
export declare const SUBPROTOCOL: "wm-refiner";
/** The prefix of the subprotocol that carries the API key: `wm-refiner.bearer.<base64url key>`. */
export declare const BEARER_PREFIX: "wm-refiner.bearer.";

// --- tensors -----------------------------------------------------------------------------------------------------
/** The safetensors dtypes this API reads and writes. */
export type DType = "F32" | "F16" | "BF16" | "I64" | "I32" | "U8" | "BOOL";

/** The typed array that holds a dtype's elements (F16/BF16: their raw bits; BOOL: one byte, 0 or 1). */
export type DataOf<D extends DType> = D extends "F32" ? Float32Array
  : D extends "F16" | "BF16" ? Uint16Array
  : D extends "I64" ? BigInt64Array
  : D extends "I32" ? Int32Array
  : Uint8Array;

/** What `Tensor.from` takes for a dtype: its typed array (used as is), or any array-like or iterable of values
 * (F16/BF16 round float values; I64 takes numbers or BigInts; BOOL true/false or 0/1). */
export type ValuesOf<D extends DType> = DataOf<D> | (D extends "I64" ? ArrayLike<number | bigint> | Iterable<number | bigint>
  : D extends "BOOL" ? ArrayLike<boolean | number> | Iterable<boolean | number>
  : ArrayLike<number> | Iterable<number>);

/** Each dtype's bytes per element and the typed array that holds its elements. */
export declare const DTYPES: {
  readonly F32: { size: number; array: Float32ArrayConstructor };
  readonly F16: { size: number; array: Uint16ArrayConstructor };
  readonly BF16: { size: number; array: Uint16ArrayConstructor };
  readonly I64: { size: number; array: BigInt64ArrayConstructor };
  readonly I32: { size: number; array: Int32ArrayConstructor };
  readonly U8: { size: number; array: Uint8ArrayConstructor };
  readonly BOOL: { size: number; array: Uint8ArrayConstructor };
};

/** A tensor: its dtype, shape and row-major little-endian bytes. */
export declare class Tensor<D extends DType = DType> {
  /** Throws a TypeError (unknown dtype, bad shape, bytes not a Uint8Array) or a RangeError (wrong byte count). */
  constructor(dtype: D, shape: readonly number[], bytes: Uint8Array);
  /** A tensor from values; throws a RangeError when their count is not the shape's. */
  static from<D extends DType>(dtype: D, shape: readonly number[], values: ValuesOf<D>): Tensor<D>;
  dtype: D;
  shape: number[];
  bytes: Uint8Array;
  /** The elements as the dtype's typed array (F16/BF16: raw bits); a copy only when `bytes` is unaligned. */
  get data(): DataOf<D>;
  /** Indices [start, end) of one axis, as a new tensor (a copy); `end` past the axis stops at its end. */
  slice(axis: number, start: number, end?: number): Tensor<D>;
  /** The elements as float32 (I64 through Number: exact below 2**53). */
  toFloat32(): Float32Array;
}

/** A safetensors file's tensors by name. */
export type Tensors = Record<string, Tensor>;
/** A safetensors header's metadata: every value a string. */
export type Metadata = Record<string, string>;

/** Tensors and string metadata into one safetensors file (the header padded to 8 bytes); a name whose value is
 * undefined is left out. */
export declare function encodeSafetensors(tensors: Record<string, Tensor | undefined>, metadata?: Metadata | null): Uint8Array;
/** One safetensors file into its tensors (views into the input, not copies) and metadata; a malformed file throws a
 * SafetensorsError saying what is wrong. */
export declare function decodeSafetensors(input: ArrayBuffer | Uint8Array): { tensors: Tensors; metadata: Metadata };

/** A malformed safetensors file. */
export declare class SafetensorsError extends Error {
  constructor(message: string);
  name: "SafetensorsError";
}

export declare function float32ToBF16Bits(value: number): number;
export declare function bf16BitsToFloat32(bits: number): number;
export declare function float32ToF16Bits(value: number): number;
export declare function f16BitsToFloat32(bits: number): number;

// --- errors ------------------------------------------------------------------------------------------------------
/** The server's error codes (docs/api.md, "Errors"). */
export type ServerErrorCode =
  | "invalid_payload" | "missing_input" | "unauthorized" | "origin_not_allowed" | "session_not_found" | "not_found"
  | "method_not_allowed" | "seq_conflict" | "stream_closed" | "stream_in_use" | "session_exists"
  | "resume_unavailable" | "session_evicted" | "payload_too_large" | "too_many_frames" | "prompt_too_long"
  | "unsupported_media_type" | "request_timeout" | "headers_too_large" | "invalid_input" | "invalid_config"
  | "invalid_request" | "not_ready" | "draining" | "too_many_sessions" | "engine_busy" | "server_busy"
  | "session_moved" | "insufficient_memory" | "over_capacity" | "internal_error";
/** The module's own codes: no answer (`unreachable`), a socket closed (`closed`), a refused WebSocket HTTP could not
 * explain (`handshake_refused`), an error answer without the server's envelope (`http_error`), `reconnect()` of a
 * stream the server closed with 1008 (`not_reconnectable`). */
export type ClientErrorCode = "unreachable" | "closed" | "handshake_refused" | "http_error" | "not_reconnectable";

/** The server's error object: code and message, and the fields some errors carry besides them
 * (`insufficient_memory`'s `bytes_needed`, `bytes_free`, `bytes_budget`; `over_capacity`'s `load_needed`...). */
export interface ErrorBody {
  code: ServerErrorCode;
  message: string;
  [field: string]: unknown;
}
/** An error answer's JSON: `{"error": {...}}`. */
export interface ErrorEnvelope {
  error: ErrorBody;
}

/** An error answer, a request without one, or a refused or closed WebSocket. */
export declare class RefinerError extends Error {
  constructor(status: number, code: string, message: string, retryAfter?: number | null,
              options?: { body?: ErrorEnvelope | null; cause?: unknown });
  name: "RefinerError";
  /** The HTTP status; 0 when there was no answer (`unreachable`) or no status to read (`closed`). */
  status: number;
  code: ServerErrorCode | ClientErrorCode;
  /** The server's message: what was wrong and what to send instead. */
  detail: string;
  /** Seconds, from the answer's `Retry-After`; null without one. */
  retryAfter: number | null;
  /** The answer's JSON as sent; null when it was not JSON or there was no answer. */
  body: ErrorEnvelope | null;
  /** For `unreachable`, the browser's TypeError; for a refused WebSocket, the HTTP refusal it was explained by. */
  cause?: unknown;
}

/** A key as the WebSocket subprotocol carries it: base64url of its UTF-8 bytes, without padding. */
export declare function base64url(text: string): string;

// --- sessions ----------------------------------------------------------------------------------------------------
export type OutputKind = "latents" | "video" | "preview";
export type VideoFormat = "uint8" | "float32" | "jpeg" | "h264";

/** A session's config as the server reports it (`GET /v1/info` `session_fields` says each field's bounds here). */
export interface SessionConfig {
  seed: number;
  fps: number;
  sink_frames: number;
  block_size: number;
  kv_max_frames: number;
  sigmas: number[];
  positions: "absolute" | "rebased";
  outputs: OutputKind[];
  video_format: VideoFormat;
  video_quality: "auto" | number;
  video_lookahead: "exact" | number;
  preview_width: number;
  realtime: boolean;
}
/** What `createSession` takes: every field optional (the server's default). */
export type SessionConfigInput = Partial<SessionConfig>;
/** `refine`'s query: every session field but `sigmas` and `realtime` (lists as arrays or comma-separated). */
export type RefineParams = Partial<Omit<SessionConfig, "sigmas" | "realtime" | "outputs">> & {
  outputs?: OutputKind[] | string;
};

export interface CreatedSession {
  session_id: string;
  config: SessionConfig;
}

export type MemoryState = "active" | "parked" | "spilled";
export interface SessionBytes {
  device: number;
  host: number;
  disk: number;
}

/** `GET /v1/sessions/{id}`. */
export interface SessionState {
  session_id: string;
  config: SessionConfig;
  frames_received: number;
  frames_returned: number;
  pending_frames: number;
  history_frames: number;
  blocks_refined: number;
  flushed: boolean;
  next_seq: number;
  kv_cache_bytes: number;
  video_state_bytes: number;
  video_frames_returned: number;
  cache_bytes: number;
  late_blocks: number | null;
  paced_blocks: number | null;
  last_lateness_s: number | null;
  worst_lateness_s: number | null;
  watchers: number;
  pending_bytes: number;
  streaming: boolean;
  detached: boolean;
  resumable_from: number;
  /** With crash checkpoints: the input frames the last one covers. */
  durable_frames?: number;
  created_at: string;
  last_active_at: string;
  state: MemoryState;
  bytes: SessionBytes & { parts: Record<string, number> };
}

/** A session's line in `GET /v1/sessions`. */
export interface SessionSummary {
  session_id: string;
  created_at: string;
  last_active_at: string;
  frames_received: number;
  frames_returned: number;
  flushed: boolean;
  streaming: boolean;
  outputs: OutputKind[];
  watchers: number;
  state: MemoryState;
  bytes: SessionBytes;
  realtime: boolean;
  late_blocks: number | null;
  /** The replica holding it (its `replica_id`). */
  replica: string;
}
export interface SessionList {
  sessions: SessionSummary[];
  /** The id to pass as `after` for the next page; null on the last. */
  next: string | null;
  /** With `after`, on one replica's page: where that session stood (its `created_at`). */
  after_created_at?: string;
  /** Behind a router with `peers`: the replicas that gave no listing in time. */
  unreachable?: string[];
}

/** `GET /v1/info` (docs/api.md, "Routes"); its nested figures are described there. */
export interface ServerInfo {
  session_fields: Record<string, unknown>;
  model: Record<string, unknown> & { caption_channels?: number };
  vae: Record<string, unknown> | null;
  default_session_config: SessionConfig;
  default_prompt: unknown;
  engine: Record<string, unknown>;
  limits: Record<string, unknown>;
  memory: Record<string, unknown>;
  ready: boolean;
  [field: string]: unknown;
}

// --- units and events --------------------------------------------------------------------------------------------
/** A chunk: its tensors (`latents` (B, C, t, H, W); on the first chunk, or to switch the prompt, `prompt_embeds`
 * (B, L, caption_channels) and optionally `prompt_attention_mask` (B, L)), or a safetensors file already encoded. */
export interface ChunkTensors {
  latents: Tensor;
  prompt_embeds?: Tensor;
  prompt_attention_mask?: Tensor;
}
export type Payload = ChunkTensors | Uint8Array | ArrayBuffer;

/** A unit: what a chunk, a stream message or a watcher delivered. Frames are latent indices, end exclusive; `seq`
 * the chunk that finalized it; `latencyMs` the server's time for it (each null when the metadata lacks it). */
export interface Unit {
  type: "unit";
  tensors: Tensors;
  metadata: Metadata;
  frameStart: number;
  frameEnd: number;
  seq: number | null;
  latencyMs: number | null;
  /** The unit's safetensors file as received, to store or pass on. */
  bytes: ArrayBuffer | Uint8Array;
}
/** `sendChunk`'s answer: the unit, and whether it is the stored answer to a repeated `seq`. */
export interface ChunkUnit extends Unit {
  replayed: boolean;
}

/** A reconnected stream's first message: where the session stands. */
export interface SessionEvent {
  type: "session";
  session_id: string;
  frames_received: number;
  frames_returned: number;
  pending_frames: number;
  next_seq: number;
  flushed: boolean;
  resume_from: number;
  resent_from: number;
  durable_frames?: number;
}
/** A watcher's event after each refined block. */
export interface BlockEvent {
  type: "block";
  frame_start: number;
  frame_end: number;
  latency_ms: number | null;
}
/** After the flush: every unit was sent; the connection closes with 1000. */
export interface DoneEvent {
  type: "done";
  frames: number;
}
/** A watcher fell behind and lost units. */
export interface DroppedEvent {
  type: "dropped";
  units: number;
}
/** A message the server refused (the stream goes on unless its code closes it), or one the module could not read
 * (codes `unreadable_unit`, `unreadable_event`). */
export interface ServerErrorEvent {
  type: "error";
  error: { code: ServerErrorCode | "unreadable_unit" | "unreadable_event"; message: string; [field: string]: unknown };
  /** After a block refined to NaN/Inf: the frames the session now holds; send again from there. */
  frames_received?: number;
}
export type ServerEvent = SessionEvent | BlockEvent | DoneEvent | DroppedEvent | ServerErrorEvent;
/** What a stream or watcher yields. */
export type Message = Unit | ServerEvent;

/** A unit's bytes as the message streams and watchers yield. */
export declare function readUnit(buffer: ArrayBuffer | Uint8Array): Unit;

// --- the client --------------------------------------------------------------------------------------------------
export type QueryValue = string | number | boolean | null | undefined;
export interface RequestOptions {
  /** A JSON body. */
  json?: unknown;
  /** A safetensors body. */
  payload?: Payload;
  /** Query parameters (null and undefined are left out). */
  query?: Record<string, QueryValue>;
}
export interface SendChunkOptions {
  /** The chunk's seq: with it the call is safe to retry, and retries itself. */
  seq?: number;
  /** Refine the pending frames as a final short block and end the stream. */
  flush?: boolean;
  /** Retries of a request that got no answer or a 503 with Retry-After (with `seq` only); default 3. */
  retries?: number;
  /** The longest wait between tries, in ms; default 10000. */
  maxWaitMs?: number;
}
export interface WatchOptions {
  outputs?: OutputKind[] | string;
  videoFormat?: VideoFormat;
  videoQuality?: "auto" | number;
  /** Latent frames already received (the last unit's `frameEnd`): the units the session kept from there come
   * first, then live ones (`?resume_from=`; refused in-band, an error event and close 1008, when they are not kept). */
  resumeFrom?: number;
}

/** The service at `baseUrl` (default: this page's origin): its http(s) URL, or a path on the page's origin. */
export declare class RefinerClient {
  /** Throws a TypeError when `baseUrl` is not an http(s) URL or a path on the page's origin. */
  constructor(baseUrl?: string | URL, options?: { apiKey?: string });
  /** The absolute URL, without a trailing slash. */
  baseUrl: string;
  /** Sent as `Authorization: Bearer` and as the WebSocket subprotocol, without the whitespace around it; may be
   * changed at any time. */
  apiKey: string;
  /** One HTTP request; resolves to the Response when it is 2xx, else rejects with a RefinerError. */
  request(method: string, path: string, options?: RequestOptions): Promise<Response>;
  /** One HTTP request's JSON answer. */
  json<T = unknown>(method: string, path: string, options?: RequestOptions): Promise<T>;
  info(): Promise<ServerInfo>;
  /** One page of the live sessions; pass `after: next` for the following page. */
  listSessions(options?: { limit?: number; after?: string | null }): Promise<SessionList>;
  /** With `id`: created under that name (PUT: repeating it with the same config is safe). */
  createSession(config?: SessionConfigInput, options?: { id?: string }): Promise<CreatedSession>;
  getSession(id: string): Promise<SessionState>;
  deleteSession(id: string): Promise<void>;
  /** Sends one chunk and resolves to the unit it finalized; `payload` null only with `flush: true`. */
  sendChunk(id: string, payload: Payload | null, options?: SendChunkOptions): Promise<ChunkUnit>;
  /** One shot: a whole clip in, the refined clip out. */
  refine(payload: Payload, params?: RefineParams): Promise<Unit>;
  /** The session's stream; `resumeFrom: N` reattaches after a lost connection (the first message is then the
   * SessionEvent). */
  stream(id: string, options?: { resumeFrom?: number }): RefinerStream;
  /** A read-only watcher: every unit the session finalizes from now on. */
  watch(id: string, options?: WatchOptions): MessageSocket;
  /** Why a WebSocket to session `id` closed before it opened, asked over HTTP (a browser shows a page only 1006). */
  handshakeRefusal(id: string, event: CloseEvent, options?: { stream?: boolean; resumeFrom?: number }): Promise<RefinerError>;
  /** The ws(s):// URL of a path of the server. */
  wsUrl(path: string, query?: Record<string, QueryValue>): string;
  /** The subprotocols a WebSocket offers: `wm-refiner`, and the key's with a key. */
  subprotocols(): string[];
}

/** A WebSocket as an async iterator of messages; iteration ends when the connection closes. */
export declare class MessageSocket implements AsyncIterableIterator<Message> {
  constructor(url: string, protocols?: string | string[],
              refusal?: ((event: CloseEvent) => Promise<RefinerError>) | null);
  readonly ws: WebSocket;
  /** Resolves once the server accepted; rejects with a RefinerError saying why if it closed first. */
  opened: Promise<this>;
  /** Resolves to the CloseEvent. */
  closed: Promise<CloseEvent>;
  /** The CloseEvent once the connection closed, else null. */
  closeEvent: CloseEvent | null;
  /** The next message, or null once the connection has closed. */
  receive(): Promise<Message | null>;
  next(): Promise<IteratorResult<Message, undefined>>;
  [Symbol.asyncIterator](): this;
  close(code?: number, reason?: string): void;
  /** Messages received and not read yet (null: the close). */
  protected queue: (Message | null)[];
  protected waiters: ((message: Message | null) => void)[];
  protected parse(data: string | ArrayBuffer): Message;
  protected push(message: Message | null): void;
}

/** The session's stream: `send` chunks, `flush()`, iterate the units; `reconnect()` after a lost connection. */
export declare class RefinerStream extends MessageSocket {
  constructor(url: string, protocols: string | string[], client: RefinerClient, sessionId: string,
              refusal?: ((event: CloseEvent) => Promise<RefinerError>) | null);
  client: RefinerClient;
  sessionId: string;
  /** The last `frameEnd` the page has read: where `reconnect()` resumes. */
  framesReturned: number;
  /** Waits for the connection to open, then sends; a RefinerError `closed` once it is closing or closed. */
  send(payload: Payload): Promise<void>;
  /** Ends the stream: the pending frames are refined as a final short block, then `done`. */
  flush(): Promise<void>;
  /** A new connection to the same session, resuming after the last frame this one read; throws a RefinerError
   * `not_reconnectable` after a close 1008 (another connection took the session over, or the resume was refused). */
  reconnect(): RefinerStream;
  protected transmit(data: string | Uint8Array | ArrayBuffer): void;
}
