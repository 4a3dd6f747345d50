"""The JavaScript module's TypeScript declarations (app/static/wm-refiner.d.ts, GET /static/wm-refiner.d.ts).

Checked with the real TypeScript compiler (Debian's ``node-typescript``, 4.8: ``tsc`` and its compiler API run by
node): docs/api.md's TypeScript example and tsconfig type-check against the declarations a live server serves, and
the emitted page runs in headless Chromium against that server; wrong calls fail ``tsc``, each on its own line; and
the declarations name exactly the module's exports (their kinds and methods, which node reads by importing the
module), the server's error codes and the session's fields, and the JSON a real server answers, so the two files
cannot drift apart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.app.conftest import DEADLINE_S, LiveServer, make_clip, payload, wait_until
from tests.app.api.test_view_browser import CHROMEDRIVER, CHROMIUM, KEY, browser  # noqa: F401 (the fixture)

ROOT = Path(__file__).parents[3]
MODULE = ROOT / "app" / "static" / "wm-refiner.js"
DECLARATIONS = ROOT / "app" / "static" / "wm-refiner.d.ts"
TSC, NODE = shutil.which("tsc"), shutil.which("node")
pytestmark = pytest.mark.skipif(
    not (TSC and NODE), reason="needs node and Debian's node-typescript (apt-get install node-typescript)"
)
DOCS_URL = "http://127.0.0.1:8000"


def api_md_typescript() -> tuple[dict, str]:
    """docs/api.md's TypeScript section: its tsconfig.json and its example."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("\n### TypeScript\n", 1)[1].split("\n## ", 1)[0]
    blocks = {block.split("\n", 1)[0]: block.split("\n", 1)[1] for block in section.split("```")[1::2]}
    return json.loads(blocks["json"]), blocks["ts"]


def tsc(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([TSC, "-p", str(folder)], capture_output=True, text=True, timeout=DEADLINE_S * 2)


def tsc_errors(output: str) -> list[tuple[int, str]]:
    """(line, TS code) of each error tsc printed for page.ts."""
    return [(int(line), code) for line, code in re.findall(r"page\.ts\((\d+),\d+\): error (TS\d+)", output)]


def project(folder: Path, config: dict, page: str, declarations: str, *, module_name: str = "wm-refiner") -> Path:
    folder.mkdir()
    (folder / "tsconfig.json").write_text(json.dumps({**config, "files": ["page.ts"]}))
    (folder / "page.ts").write_text(page)
    (folder / f"{module_name}.d.ts").write_text(declarations)
    return folder


def test_the_declarations_are_served_beside_the_module_without_the_key(make_settings):
    with LiveServer(make_settings(api_key=KEY)) as server, httpx.Client(base_url=server.base_url) as http:
        response = http.get("/static/wm-refiner.d.ts")  # no key, like the module
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/typescript; charset=utf-8"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.text == DECLARATIONS.read_text()
        assert http.get("/static/wm-refiner.d.ts", params={"v": "2"}).status_code == 200  # a cache-buster, as for the .js
        assert http.get("/static/wm-refiner.ts").status_code == 401  # nothing else under /static is public


def test_the_module_names_its_declarations_in_the_header_deno_reads(make_settings):
    """Deno takes the types of a module imported by URL from its X-TypeScript-Types header, resolved against the
    module's URL: the header is relative, so it names the declarations beside the module on this server and behind a
    proxy that serves the server under a path of its own (the server does not know that path)."""
    from urllib.parse import urljoin

    with LiveServer(make_settings(api_key=KEY)) as server, httpx.Client(base_url=server.base_url) as http:
        module = http.get("/static/wm-refiner.js")  # no key
        assert module.status_code == 200, module.text
        named = module.headers["x-typescript-types"]
        declarations = http.get(urljoin(f"{server.base_url}/static/wm-refiner.js", named))  # no key either
        assert declarations.status_code == 200, declarations.text
        assert declarations.headers["content-type"] == "application/typescript; charset=utf-8"
        assert declarations.text == DECLARATIONS.read_text()
        assert "x-typescript-types" not in declarations.headers  # the declarations are the types
    assert urljoin("https://example.org/refiner/static/wm-refiner.js?v=2", named) == \
        "https://example.org/refiner/static/wm-refiner.d.ts"


# Runs in the page: the module script tsc emitted, its console.log collected; window.result once it finished.
RUN_MODULE = """
const [code] = arguments;
window.result = null;
window.addEventListener("error", (event) => { window.result = { error: String(event.message) }; });
window.addEventListener("unhandledrejection", (event) => { window.result = { error: String(event.reason && event.reason.stack || event.reason) }; });
const script = document.createElement("script");
script.type = "module";
script.textContent = code;
document.head.appendChild(script);
"""


@pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
                    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
def test_the_typescript_example_in_api_md_type_checks_against_the_served_declarations_and_runs(
        tmp_path, make_settings, browser):
    config, example = api_md_typescript()
    assert config["compilerOptions"]["paths"] == {f"{DOCS_URL}/static/wm-refiner.js": ["./wm-refiner.d.ts"]}
    with LiveServer(make_settings()) as server:
        declarations = httpx.get(f"{server.base_url}/static/wm-refiner.d.ts").text

        # The module imported from the server by its URL, its types found through `paths`.
        folder = project(tmp_path / "url", config, example, declarations)
        checked = tsc(folder)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        emitted = (folder / "page.js").read_text()
        assert f'from "{DOCS_URL}/static/wm-refiner.js"' in emitted  # the import as written, for the browser

        # The emitted page, in the browser, against this server.
        code = ("const console = { log: (...values) => window.logged.push(values) };\nwindow.logged = [];\n"
                + emitted.replace(DOCS_URL, server.base_url) + "\nwindow.result = { value: window.logged };")
        browser.get(f"{server.base_url}/health")
        browser.execute_script(RUN_MODULE, code)
        result = wait_until(lambda: browser.execute_script("return window.result"), "the page to finish")
    assert "error" not in result, result["error"]
    assert result["value"] == [[[[0, 1], [1, 4], [4, 5]], 128 * 3 * 16], [409, "stream_closed"]]

    # A bundled app: the module and its declarations side by side, imported by a relative path.
    beside = project(tmp_path / "beside", {"compilerOptions": {k: v for k, v in config["compilerOptions"].items()
                                                               if k not in ("paths", "baseUrl")}},
                     example.replace(f"{DOCS_URL}/static/wm-refiner.js", "./wm-refiner.js"), declarations)
    shutil.copy(MODULE, beside / "wm-refiner.js")
    checked = tsc(beside)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# Each line marked `// wrong` is a call the module refuses at run time (or silently misreads); tsc must refuse each,
# and nothing else (the lines between are right, and must pass).
WRONG_CALLS = """\
import { RefinerClient, RefinerError, Tensor } from "./wm-refiner.js";
const client = new RefinerClient("http://127.0.0.1:8000");
const prompt = Tensor.from("F32", [1, 8, 32], new Float32Array(8 * 32));
await client.sendChunk("s", { prompt_embeds: prompt });  // wrong: no latents
await client.sendChunk("s", null, { flush: true });
Tensor.from("F64", [1], [1]);  // wrong: no such dtype
const halves: Uint16Array = Tensor.from("BF16", [2], [1.5, 2]).data;
client.stream("s", { resume_from: 4 });  // wrong: resumeFrom
client.stream("s", { resumeFrom: 4 });
const ints: Float32Array = Tensor.from("I64", [1], [1n]).data;  // wrong: a BigInt64Array
for await (const message of client.watch("s")) {
  if (message.type === "unit") console.log(message.frameStart, message.tensors.latents.shape);
  else console.log(message.frameStart);  // wrong: events have no frameStart
}
try { await client.info(); } catch (err) { if (err instanceof RefinerError) console.log(err.retryAfter, err.body?.error.code); }
const [a, b]: [number, string] = [1, "x"];
console.log(halves, ints, a, b);
"""


def test_wrong_calls_fail_tsc_each_on_its_own_line(tmp_path):
    """The negative control of the test above: the declarations are not so loose that anything passes."""
    config = {"compilerOptions": {"target": "es2022", "module": "es2022", "moduleResolution": "node",
                                  "lib": ["es2022", "dom"], "strict": True, "noEmit": True}}
    folder = project(tmp_path / "wrong", config, WRONG_CALLS, DECLARATIONS.read_text())
    shutil.copy(MODULE, folder / "wm-refiner.js")
    checked = tsc(folder)
    wrong = [number for number, line in enumerate(WRONG_CALLS.splitlines(), 1) if "// wrong" in line]
    assert checked.returncode != 0
    errors = tsc_errors(checked.stdout)
    assert sorted({line for line, _ in errors}) == wrong, checked.stdout
    assert "Property 'latents' is missing" in checked.stdout and "'\"F64\"' is not assignable" in checked.stdout
    assert "Did you mean to write 'resumeFrom'?" in checked.stdout


# Runs in node: imports the module and describes each export (a class: its methods along the prototype chain and
# its static members); reads the declarations with TypeScript's compiler API and describes each export the same way,
# and each exported type (a union of strings: its members; an interface: its properties, optional or not).
DESCRIBE = r"""
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";
const [modulePath, dtsPath, tsPath] = process.argv.slice(1);
const ts = createRequire(tsPath)(tsPath);
const name = (key) => (typeof key === "symbol" ? `[${key.description}]` : key);

const module = await import(pathToFileURL(modulePath)), runtime = {};
for (const [key, value] of Object.entries(module)) {
  if (typeof value !== "function") { runtime[key] = { kind: "const" }; continue; }
  if (!/^class\b/.test(Function.prototype.toString.call(value))) { runtime[key] = { kind: "function" }; continue; }
  const methods = new Set();
  for (let proto = value.prototype; proto && proto !== Object.prototype && proto !== Error.prototype; proto = Object.getPrototypeOf(proto)) {
    for (const member of Reflect.ownKeys(proto)) if (member !== "constructor") methods.add(name(member));
  }
  const statics = Object.getOwnPropertyNames(value).filter((k) => !["length", "name", "prototype"].includes(k));
  runtime[key] = { kind: "class", methods: [...methods].sort(), statics: statics.sort() };
}

const program = ts.createProgram([dtsPath], { strict: true, noEmit: true, target: ts.ScriptTarget.ES2022,
                                              lib: ["lib.es2022.d.ts", "lib.dom.d.ts"] });
const checker = program.getTypeChecker(), source = program.getSourceFile(dtsPath);
const diagnostics = ts.getPreEmitDiagnostics(program).map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
const ours = (symbol) => (symbol.declarations || []).some((d) => d.getSourceFile() === source);
const memberName = (symbol) => {
  const d = symbol.declarations[0];
  return d.name && ts.isComputedPropertyName(d.name) ? d.name.getText() : symbol.name;
};
const isMethod = (symbol) => symbol.declarations.some((d) =>
  ts.isMethodDeclaration(d) || ts.isGetAccessorDeclaration(d) || ts.isSetAccessorDeclaration(d));
const declared = {}, types = {};
for (const symbol of checker.getExportsOfModule(checker.getSymbolAtLocation(source))) {
  if (symbol.flags & ts.SymbolFlags.Class) {
    const instance = checker.getDeclaredTypeOfSymbol(symbol);
    const methods = checker.getPropertiesOfType(instance).filter((p) => ours(p) && isMethod(p)).map(memberName);
    const statics = [...symbol.exports.values()].filter((p) => p.name !== "prototype").map(memberName);
    declared[symbol.name] = { kind: "class", methods: methods.sort(), statics: statics.sort() };
  } else if (symbol.flags & ts.SymbolFlags.Function) declared[symbol.name] = { kind: "function" };
  else if (symbol.flags & ts.SymbolFlags.Variable) declared[symbol.name] = { kind: "const" };
  else if (symbol.flags & ts.SymbolFlags.Interface) {
    const properties = checker.getPropertiesOfType(checker.getDeclaredTypeOfSymbol(symbol));
    types[symbol.name] = { required: properties.filter((p) => !(p.flags & ts.SymbolFlags.Optional)).map((p) => p.name).sort(),
                           optional: properties.filter((p) => p.flags & ts.SymbolFlags.Optional).map((p) => p.name).sort() };
  } else {
    const type = checker.getDeclaredTypeOfSymbol(symbol);
    if (type.isUnion() && type.types.every((t) => t.isStringLiteral())) types[symbol.name] = { literals: type.types.map((t) => t.value).sort() };
  }
}
console.log(JSON.stringify({ runtime, declared, types, diagnostics, dtypes: Object.keys(module.DTYPES).sort() }));
"""


@pytest.fixture(scope="module")
def described() -> dict:
    compiler = Path(os.path.realpath(TSC)).parents[1]  # Debian: /usr/share/nodejs/typescript/bin/tsc
    out = subprocess.run([NODE, "--input-type=module", "-e", DESCRIBE, str(MODULE), str(DECLARATIONS), str(compiler)],
                         capture_output=True, text=True, timeout=DEADLINE_S * 2)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_declarations_name_exactly_the_modules_exports_and_their_methods(described):
    assert described["diagnostics"] == []
    runtime, declared = described["runtime"], described["declared"]
    assert len(runtime) > 10
    assert sorted(declared) == sorted(runtime), "exports the module has but the declarations lack, or the reverse"
    for name, what in runtime.items():
        assert declared[name] == what, name  # a class for a class, the same methods and statics
    assert described["types"]["DType"]["literals"] == described["dtypes"]


def test_the_declared_error_codes_and_session_fields_are_the_servers(described):
    from app.core.error_kinds import ERRORS
    from wm_refiner_client import spec

    types = described["types"]
    assert types["ServerErrorCode"]["literals"] == sorted(ERRORS)
    assert types["SessionConfig"]["required"] == sorted(spec.NAMES)
    assert types["OutputKind"]["literals"] == sorted(kind.name for kind in spec.KINDS)
    assert types["VideoFormat"]["literals"] == sorted(spec.BY_NAME["video_format"].choices)


def test_the_declared_answers_have_the_fields_a_server_sends(described, client):
    """SessionState, SessionSummary, SessionList, CreatedSession and SessionEvent against a real app's JSON: every
    field it sends is declared, and every declared field that is not optional is sent."""
    latents, embeds, mask = make_clip(frames=4)
    created = client.post("/v1/sessions", json={})
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    response = client.post(f"/v1/sessions/{session_id}/chunks", content=payload(latents, embeds, mask),
                           headers={"content-type": "application/octet-stream"})
    assert response.status_code == 200, response.text
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream?resume_from=4") as ws:  # the frames the chunk returned
        event = ws.receive_json()
    listing = client.get("/v1/sessions").json()
    answers = {"CreatedSession": created.json(), "SessionState": client.get(f"/v1/sessions/{session_id}").json(),
               "SessionList": listing, "SessionSummary": listing["sessions"][0], "SessionEvent": event,
               "SessionConfig": created.json()["config"]}
    for name, answer in answers.items():
        declared = described["types"][name]
        assert set(declared["required"]) <= set(answer), (name, set(declared["required"]) - set(answer))
        assert set(answer) <= set(declared["required"]) | set(declared["optional"]), \
            (name, set(answer) - set(declared["required"]) - set(declared["optional"]))
