"""What a new user trips on first (issue 26 and a later walkthrough): a server address without a scheme or with a
typo, a server that is not there, https:// to a plain-HTTP server or to a certificate the client does not trust, a
full server's retries (what the log says, how long they wait), and the command line's answers to them."""

from __future__ import annotations

import asyncio
import datetime
import http.server
import ipaddress
import json
import logging
import ssl
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import wm_refiner_client as wm
from bench.live import ROOT, free_port
from wm_refiner_client import AsyncClient, Client
from wm_refiner_client.protocol import FIRST_CONTACT_ATTEMPTS, RequestAttempts
from wm_refiner_client.retry import RetryPolicy

from .test_cli import run_cli


@pytest.mark.parametrize("address,fix", [
    ("localhost:8000", "give http://localhost:8000"),
    ("127.0.0.1:8000", "give http://127.0.0.1:8000"),
    ("htp://localhost:8000", "give http://, https://"),
    ("http://", "names no host"),
    ("http://localhost:80000", "bad port"),
])
def test_an_address_no_request_could_reach_is_refused_at_once_with_the_fix(address, fix):
    for make in (Client, AsyncClient):
        with pytest.raises(ValueError, match=fix):
            make(address)


def test_the_environment_address_is_checked_and_named(monkeypatch):
    monkeypatch.setenv("WM_REFINER_URL", "localhost:8000")
    with pytest.raises(ValueError, match=r"\$WM_REFINER_URL 'localhost:8000' has no scheme"):
        Client()


def test_a_base_url_ending_in_v1_is_told_to_drop_it(server):
    """The API's own path given as the base (a proxy may put the service under any prefix, /v1 included, so the
    client takes it): the 404 of /v1/v1/... says what happened."""
    with Client(f"{server.base_url}/v1") as client:
        with pytest.raises(wm.NotFoundError, match=r"no route /v1/v1/info; the client's base URL seems to end in "
                                                    r"/v1: give it without \(this path would be /v1/info\)"):
            client.info()


def test_websocket_schemes_are_taken_for_http():
    assert Client("ws://127.0.0.1:8000/").base_url == "http://127.0.0.1:8000"
    assert Client("http://host/proxy/").base_url == "http://host/proxy"  # a proxy's path prefix is kept
    assert Client("wss://example.test").base_url == "https://example.test"


def recorded_waits(monkeypatch, module) -> list[float]:
    """The client's retry waits (``time.sleep`` for ``"sync"``, ``asyncio.sleep`` for ``"async"``), recorded and
    skipped. Only this thread's: a server on a thread of this process (``ThreadServer``) waits as usual."""
    waits: list[float] = []
    here = threading.get_ident()
    if module == "sync":
        real_sleep = time.sleep

        def sleep(seconds):
            if threading.get_ident() != here:
                return real_sleep(seconds)
            waits.append(seconds)

        monkeypatch.setattr("wm_refiner_client.client.time.sleep", sleep)
    else:
        real_async_sleep = asyncio.sleep

        async def sleep(seconds, *args, **kwargs):
            if threading.get_ident() != here:
                return await real_async_sleep(seconds, *args, **kwargs)
            waits.append(seconds)

        monkeypatch.setattr("wm_refiner_client.aio.asyncio.sleep", sleep)
    return waits


@pytest.mark.parametrize("module", ["sync", "async"])
def test_a_refused_port_fails_after_a_few_tries_naming_the_likely_cause(monkeypatch, caplog, module):
    waits = recorded_waits(monkeypatch, module)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(wm.TransportError) as failed, caplog.at_level(logging.INFO, logger="wm_refiner_client"):
        if module == "sync":
            Client(url).info()
        else:
            asyncio.run(AsyncClient(url).info())
    # each retry's log line counts the tries a first contact gets, not the policy's ten
    notes = [r.getMessage() for r in caplog.records if r.name == "wm_refiner_client"]
    assert [note.split("; ")[-1].split(" in ")[0] for note in notes] == [
        f"try {n} of {FIRST_CONTACT_ATTEMPTS}" for n in range(2, FIRST_CONTACT_ATTEMPTS + 1)]
    assert all(note.startswith("GET /v1/info: ConnectError (") for note in notes), notes
    message = str(failed.value)
    assert "connection refused" in message and url in message and "python -m app serve" in message
    # the policy's ten tries would wait ~30 s; a first contact waits FIRST_CONTACT_ATTEMPTS - 1 short backoffs
    assert len(waits) == FIRST_CONTACT_ATTEMPTS - 1
    assert sum(waits) <= sum(RetryPolicy().backoff_s * 2**n for n in range(FIRST_CONTACT_ATTEMPTS - 1))


def test_an_unknown_host_fails_at_once(monkeypatch):
    waits = recorded_waits(monkeypatch, "sync")
    with pytest.raises(wm.TransportError, match="cannot resolve the host of http://no-such-host.invalid:8000"):
        Client("http://no-such-host.invalid:8000").info()
    assert waits == []


def test_once_the_server_answered_a_refused_connection_gets_the_whole_policy():
    refused = ConnectionRefusedError(111, "Connection refused")
    policy = RetryPolicy(attempts=6, restart_timeout_s=60.0)
    now = [0.0]
    first = RequestAttempts(policy, "GET /v1/info", first_contact=True, server="http://h:1")
    later = RequestAttempts(policy, "GET /v1/info", first_contact=False, server="http://h:1", clock=lambda: now[0])
    for _ in range(FIRST_CONTACT_ATTEMPTS - 1):
        first.after_transport_error(refused, never_sent=True)
    with pytest.raises(wm.TransportError, match="nothing listens at http://h:1"):
        first.after_transport_error(refused, never_sent=True)
    # A restart: retried for restart_timeout_s, however many tries that takes (a 13 B model loads for minutes).
    for _ in range(60):
        later.after_transport_error(refused, never_sent=True)
        now[0] += 1.0
    assert "the server is restarting: try 61 in" in later.retry_note(1.0)
    now[0] += 1.0
    with pytest.raises(wm.TransportError, match=r"not back 60 s after it went down .*ConnectionRefusedError"):
        later.after_transport_error(refused, never_sent=True)


def test_the_command_line_refuses_a_bad_server_with_the_subcommands_usage(tmp_path):
    result = run_cli("stream", "--server", "localhost:8000", "--input", str(tmp_path / "in.safetensors"),
                     "--output", str(tmp_path / "out.safetensors"))
    assert result.returncode == 2
    assert "usage: python -m app stream" in result.stderr
    assert "--server 'localhost:8000' has no scheme; give http://localhost:8000" in result.stderr


def test_the_command_line_says_when_nothing_listens(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = run_cli("sessions", "--server", url)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: GET /v1/sessions: nothing listens at {url} (connection refused)")


# --- https:// to a server that does not speak it, or whose certificate is not trusted -------------------------------
@pytest.fixture(scope="module")
def full_server(make_settings):
    """A plain-HTTP server (the service, on http://) holding its maximum of sessions: max_sessions=1, one taken."""
    from bench.live import ThreadServer

    with ThreadServer(make_settings(max_sessions=1)) as live, Client(live.base_url) as client:
        client.create_session()
        yield live


def call(module: str, url: str, operation: str, **kwargs):
    """``operation`` (a method name) of a new ``Client`` (``"sync"``) or ``AsyncClient`` (``"async"``) on ``url``."""
    if module == "sync":
        with Client(url, **kwargs) as client:
            return getattr(client, operation)()

    async def run():
        async with AsyncClient(url, **kwargs) as client:
            return await getattr(client, operation)()

    return asyncio.run(run())


def ssl_errors_in(exc: BaseException) -> list[ssl.SSLError]:
    """The ``ssl.SSLError``s among ``exc`` and the exceptions it was raised from."""
    found, seen = [], exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            found.append(seen)
        seen = seen.__cause__ or seen.__context__
    return found


@pytest.mark.parametrize("module", ["sync", "async"])
def test_https_to_a_plain_http_server_fails_at_once_naming_http(full_server, monkeypatch, module):
    waits = recorded_waits(monkeypatch, module)
    url = f"https://127.0.0.1:{full_server.port}"
    with pytest.raises(wm.TransportError) as failed:
        call(module, url, "sessions")
    message = str(failed.value)
    assert message.startswith(f"GET /v1/sessions: the server at {url} does not speak TLS (HTTPS)"), message
    assert "plain-HTTP server" in message and f"give http://127.0.0.1:{full_server.port} instead" in message
    assert ssl_errors_in(failed.value)  # the handshake's own error stays attached
    assert waits == []  # final at once: no retry waited (the policy's ten tries waited ~27 s)


def stream_without_a_request(module: str, url: str) -> None:
    """One frame streamed by a handle made without a request (``Session(client, id, config)``): the stream's
    WebSocket is this client's first contact with ``url``."""
    frames = [np.zeros((1, 128, 1, 4, 4), np.float32)]
    if module == "sync":
        with Client(url) as client:
            list(wm.Session(client, "first-contact-ws", {}).stream(frames))
        return

    async def run():
        async with AsyncClient(url) as client:
            return [unit async for unit in wm.AsyncSession(client, "first-contact-ws", {}).stream(frames)]

    asyncio.run(run())


@pytest.mark.parametrize("module", ["sync", "async"])
def test_a_stream_whose_first_contact_is_its_websocket_says_the_cause_at_once(full_server, monkeypatch, module):
    """A handle made without a request (``Session(client, id, config)``) contacts the server first by its stream's
    WebSocket: https:// to the plain-HTTP server is the same final cause as over HTTP, not ten reconnections."""
    url = f"https://127.0.0.1:{full_server.port}"
    waits = recorded_waits(monkeypatch, module)
    with pytest.raises(wm.TransportError) as failed:
        stream_without_a_request(module, url)
    message = str(failed.value)
    assert message.startswith(f"WebSocket /v1/sessions/first-contact-ws/stream: the server at {url} does not speak "
                              "TLS (HTTPS)"), message
    assert f"give http://127.0.0.1:{full_server.port} instead" in message
    assert failed.value.final and ssl_errors_in(failed.value)
    assert not any(waits)  # no reconnection waited (the first connection "waits" 0 s)


@pytest.mark.parametrize("module", ["sync", "async"])
def test_a_stream_whose_first_contact_is_refused_stops_after_the_first_contacts_tries(monkeypatch, module):
    """Nothing listening where a stream's WebSocket is the first contact: the same few tries as over HTTP
    (FIRST_CONTACT_ATTEMPTS), then the cause, not the policy's ten reconnections."""
    url = f"http://127.0.0.1:{free_port()}"
    waits = recorded_waits(monkeypatch, module)
    with pytest.raises(wm.TransportError) as failed:
        stream_without_a_request(module, url)
    assert "nothing listens at" in str(failed.value) and "python -m app serve" in str(failed.value)
    assert len([wait for wait in waits if wait]) == FIRST_CONTACT_ATTEMPTS - 1  # reconnection waits


def test_the_command_line_says_https_to_a_plain_http_server_is_the_wrong_scheme(full_server):
    url = f"https://127.0.0.1:{full_server.port}"
    result = run_cli("sessions", "--server", url)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: GET /v1/sessions: the server at {url} does not speak TLS (HTTPS)")
    assert f"give http://127.0.0.1:{full_server.port} instead" in result.stderr


def self_signed_certificate(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 that signs itself (its own CA), and its key: PEM files in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wm-refiner test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


class InfoHandler(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the JSON ``{"tls": "ok"}``."""

    def do_GET(self):
        body = b'{"tls": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def tls_server(tmp_path):
    """``(https URL, certificate file)`` of a TLS server on 127.0.0.1 whose certificate no public CA signed."""
    cert_file, key_file = self_signed_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), InfoHandler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="tls-stub", daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert_file
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize("module", ["sync", "async"])
def test_an_untrusted_certificate_fails_at_once_naming_the_fix_that_works(tls_server, monkeypatch, module):
    url, cert_file = tls_server
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    waits = recorded_waits(monkeypatch, module)
    with pytest.raises(wm.TransportError) as failed:
        call(module, url, "info")
    message = str(failed.value)
    assert message.startswith(f"GET /v1/info: the TLS certificate of {url} cannot be verified"), message
    assert "self-signed certificate" in message  # OpenSSL's reason, as it gave it
    assert "fix the server's certificate" in message and "$SSL_CERT_FILE" in message
    assert "does not speak TLS" not in message  # it does: a different cause
    assert isinstance(ssl_errors_in(failed.value)[0], ssl.SSLCertVerificationError)
    assert waits == []
    # The fix the message names works: the server's certificate (its own CA) in $SSL_CERT_FILE.
    monkeypatch.setenv("SSL_CERT_FILE", cert_file)
    assert call(module, url, "info") == {"tls": "ok"}


@pytest.mark.parametrize("error,cause", [
    (ssl.SSLError(1, "[SSL] record layer failure (_ssl.c:1000)"), "does not speak TLS (HTTPS)"),  # OpenSSL >= 3.2
    (ssl.SSLError(1, "[SSL: SSLV3_ALERT_HANDSHAKE_FAILURE] sslv3 alert handshake failure (_ssl.c:1000)"),
     "the TLS (HTTPS) handshake with https://h:1 failed"),
])
def test_a_tls_failure_of_a_first_contact_is_final_at_once(error, cause):
    import httpx

    try:
        try:
            raise error
        except ssl.SSLError as inner:
            raise httpx.ConnectError(str(inner)) from inner
    except httpx.ConnectError as wrapped:
        failure = wrapped
    first = RequestAttempts(RetryPolicy(), "GET /v1/info", first_contact=True, server="https://h:1")
    with pytest.raises(wm.TransportError, match=r"give http://h:1 instead") as failed:
        first.after_transport_error(failure, never_sent=True)
    assert cause in str(failed.value) and first.failures == 1
    # Once the server answered over TLS, a failed handshake is a hiccup of a server that speaks it: retried.
    later = RequestAttempts(RetryPolicy(), "GET /v1/info", first_contact=False, server="https://h:1")
    assert later.after_transport_error(failure, never_sent=True) > 0
    # The same error after the connection was made (the request had left: a read failed) is no wrong address.
    reading = RequestAttempts(RetryPolicy(), "GET /v1/info", first_contact=True, server="https://h:1")
    try:
        try:
            raise error
        except ssl.SSLError as inner:
            raise httpx.ReadError(str(inner)) from inner  # the SSL error in its chain, as httpx raises it
    except httpx.ReadError as wrapped:
        assert reading.after_transport_error(wrapped, never_sent=False) > 0


def test_a_handshake_cut_off_is_retried_as_a_refused_connection_is():
    """An EOF in the middle of a TLS handshake is what a restarting server or proxy does too: not final at once, but
    the first contact's few tries, then the cause and the plain-HTTP fix."""
    import httpx

    try:
        try:
            raise ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:1000)")
        except ssl.SSLError as inner:
            raise httpx.ConnectError(str(inner)) from inner
    except httpx.ConnectError as wrapped:
        failure = wrapped
    first = RequestAttempts(RetryPolicy(), "GET /v1/info", first_contact=True, server="https://h:1")
    for _ in range(FIRST_CONTACT_ATTEMPTS - 1):
        assert first.after_transport_error(failure, never_sent=True) > 0
    with pytest.raises(wm.TransportError, match=r"was cut off .*give http://h:1 instead"):
        first.after_transport_error(failure, never_sent=True)


# --- a full server: the retries say what they wait for, and how long they can take ----------------------------------
@pytest.mark.parametrize("module", ["sync", "async"])
def test_a_full_server_is_retried_saying_why_and_which_try_within_the_documented_bound(full_server, monkeypatch,
                                                                                        caplog, module):
    waits = recorded_waits(monkeypatch, module)
    policy = RetryPolicy()
    with caplog.at_level(logging.INFO, logger="wm_refiner_client"):
        with pytest.raises(wm.TooManySessionsError):
            call(module, full_server.base_url, "create_session")
    retries = [r for r in caplog.records if r.name == "wm_refiner_client" and "POST /v1/sessions" in r.getMessage()]
    assert [r.levelno for r in retries] == [logging.INFO] * (policy.attempts - 1)
    first = retries[0].getMessage()
    assert first.startswith("POST /v1/sessions: 503 too_many_sessions (the server holds its maximum of 1 sessions "
                            "(max_sessions); delete one you no longer need"), first
    assert [r.getMessage().rsplit("; ", 1)[1] for r in retries] == [
        f"try {n} of {policy.attempts} in 30.0 s" for n in range(2, policy.attempts + 1)]
    assert all(len(r.getMessage()) < 220 for r in retries)  # the server's message shortened
    # The server asks for 600 s (its idle session's release); each wait is capped at max_retry_after_s, so the
    # defaults wait (attempts - 1) * 30 s = 4.5 min in all, as docs/client.md says.
    assert waits == [policy.max_retry_after_s] * (policy.attempts - 1) and sum(waits) == 270

    caplog.clear()
    waits.clear()
    with caplog.at_level(logging.INFO, logger="wm_refiner_client"):
        with pytest.raises(wm.TooManySessionsError):  # the documented way to fail fast instead
            call(module, full_server.base_url, "create_session", retry=RetryPolicy(attempts=1))
    assert waits == [] and not [r for r in caplog.records if r.name == "wm_refiner_client"]


# --- the optional video libraries (the `video` extra) ------------------------------------------------------------
@pytest.fixture(scope="module")
def video_server(make_settings, tmp_path_factory):
    from bench.live import ThreadServer
    from models.checkpoints import write_vae_checkpoint

    vae = write_vae_checkpoint(tmp_path_factory.mktemp("first-hour-vae"), "tiny-vae")
    with ThreadServer(make_settings(vae=str(vae))) as live:
        yield live


@pytest.mark.parametrize("video_format,module,package", [("h264", "av", "PyAV"), ("jpeg", "PIL", "Pillow")])
def test_a_server_without_the_encoder_refuses_the_format_at_creation(video_server, monkeypatch, video_format, module,
                                                                     package):
    with Client(video_server.base_url) as client:
        kept = client.create_session(outputs=["latents", "video"], video_format=video_format)  # installed: fine
        monkeypatch.setitem(sys.modules, module, None)  # as if the extra were not installed: the import fails
        with pytest.raises(wm.InvalidConfigError) as refused:
            client.create_session(outputs=["latents", "video"], video_format=video_format)
        assert refused.value.status == 422
        assert f"needs {package}" in refused.value.message and "pip install -e '.[video]'" in refused.value.message
        client.create_session(outputs=["latents", "video"], video_format="uint8")  # raw video needs neither
        # A watcher asking for the format is refused the same way, before it is accepted.
        with pytest.raises(wm.InvalidRequestError, match=f"needs {package}"):
            client._connect(f"/v1/sessions/{kept.id}/watch", {"video_format": video_format})
        kept.delete()


@pytest.mark.parametrize("module", ["sync", "async"])
def test_a_handle_made_without_the_config_reads_a_video_sessions_answers_whole(video_server, module):
    """A handle made without a request (``Session(client, id, {})``) does not know the session's outputs: the limit
    on a chunk's answer assumes the widest (video as float32), not the default's latents alone, which refused this
    session's flush (its video's tail, 12 MB) as over 9.4 MB."""
    from .conftest import clip

    latents, prompt, mask = clip(12)

    async def send_async(session_id):
        async with AsyncClient(video_server.base_url) as client:
            handle = wm.AsyncSession(client, session_id, {})
            return [await handle.send(latents, prompt, mask), await handle.flush()]

    with Client(video_server.base_url) as client:
        session = client.create_session(outputs=["latents", "video"], video_format="float32")
        if module == "sync":
            handle = wm.Session(client, session.id, {})
            units = [handle.send(latents, prompt, mask), handle.flush()]
        else:
            units = asyncio.run(send_async(session.id))
        session.delete()
    assert units[-1].frame_end == 12
    assert sum(unit.video.shape[1] for unit in units) == 8 * (12 - 1) + 1 - 1  # F = 8 (T - 1) + 1 - S


def test_stream_video_without_pyav_is_refused_before_anything_is_sent(video_server, tmp_path):
    from .test_cli import cli_env, write_clip

    source = write_clip(tmp_path / "in.safetensors")
    with Client(video_server.base_url) as client:
        before = {s.session_id for s in client.sessions()}
    script = ("import sys; sys.modules['av'] = None\n"  # PyAV not installed
              "from app.cli.commands import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run(
        [sys.executable, "-c", script, "stream", "--server", video_server.base_url, "--input", str(source),
         "--output", str(tmp_path / "out.safetensors"), "--video", str(tmp_path / "out.mp4")],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--video needs PyAV" in result.stderr and "pip install -e '.[video]'" in result.stderr
    assert not (tmp_path / "out.mp4").exists() and not (tmp_path / "out.safetensors").exists()
    with Client(video_server.base_url) as client:
        assert {s.session_id for s in client.sessions()} == before  # no session was created


# --- a rerun of a finished stream -----------------------------------------------------------------------------------
def test_a_rerun_of_a_complete_stream_says_so_from_the_file_after_the_server_forgot_the_session(video_server,
                                                                                                 tmp_path):
    from safetensors import safe_open

    from .test_cli import write_clip

    source = write_clip(tmp_path / "in.safetensors")
    output = tmp_path / "out.safetensors"
    args = ["stream", "--server", video_server.base_url, "--input", str(source), "--output", str(output),
            "--session-id", "finished-run-1", "--seed", "7"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    with safe_open(str(output), framework="np") as file:
        assert file.metadata()["wm_refiner.complete"] == "true"
        written = file.get_tensor("latents")
    with Client(video_server.base_url) as client:  # what retention does to a finished session after a while
        client.delete_session("finished-run-1")

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("session finished-run-1 is complete:") and again.stderr == ""
    assert np.array_equal(load_file(str(output))["latents"], written)  # untouched
    with Client(video_server.base_url) as client:
        assert "finished-run-1" not in {s.session_id for s in client.sessions()}  # the server was not asked

    # Another session flag is not this run: the server is asked (a deleted id may be created again: a new run).
    other = run_cli(*args[:-1], "8")
    assert other.returncode == 0 and other.stdout.startswith("refined 24 frames"), other.stderr
    with safe_open(str(output), framework="np") as file:
        assert json.loads(file.metadata()["wm_refiner.config"])["seed"] == 8


# --- small ones -----------------------------------------------------------------------------------------------------
def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_flag_meant():
    result = run_cli("sessions", "--jsno")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m app sessions")
    assert "unrecognized arguments: --jsno (--jsno: did you mean --json?)" in result.stderr


def test_the_clients_websockets_close_fast_and_lower_keepalive_failures(video_server, caplog):
    import logging

    from wm_refiner_client._common import CLOSE_TIMEOUT_S, WS_LOG

    with Client(video_server.base_url) as client:
        session = client.create_session()
        ws = client._connect(f"/v1/sessions/{session.id}/watch")
        try:
            # a close the client starts waits at most this long for the server's answer (bench/ctrl_c.py)
            assert ws.close_timeout == CLOSE_TIMEOUT_S <= 2
            assert ws.logger.logger is WS_LOG  # websockets wraps it in a LoggerAdapter
        finally:
            ws.close()
    with caplog.at_level(logging.DEBUG, logger=WS_LOG.name):
        try:
            raise RuntimeError("the connection closed under the ping")
        except RuntimeError:
            WS_LOG.error("keepalive ping failed", exc_info=True)
        WS_LOG.error("something else")
    levels = {record.getMessage(): record.levelno for record in caplog.records}
    assert levels == {"keepalive ping failed": logging.DEBUG, "something else": logging.ERROR}


def test_quickstart_help_is_the_whole_description():
    result = subprocess.run([sys.executable, "examples/quickstart.py", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    assert "then the sessions listed and deleted." in " ".join(result.stdout.split())


def test_the_input_recipe_writes_a_file_stream_refines(video_server, tmp_path, monkeypatch):
    from .test_readme import python_blocks, section

    (code,) = python_blocks(section("### Writing the input file", "docs/client.md"))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/client.md", "exec"), {})
    result = run_cli("stream", "--server", video_server.base_url, "--input", str(tmp_path / "in.safetensors"),
                     "--output", str(tmp_path / "out.safetensors"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refined 11 frames")
    assert load_file(str(tmp_path / "out.safetensors"))["latents"].shape == (1, 128, 11, 4, 4)


# --- the wire format as docs/api.md states it, built by hand ---------------------------------------------------------
def raw_safetensors(tensors: dict[str, tuple[str, tuple[int, ...], bytes]], pad: int = 0) -> bytes:
    """u64 little-endian header length, the JSON header (padded with ``pad`` spaces), the data back to back."""
    import struct

    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


def raw_metadata(data: bytes) -> dict[str, str]:
    """The header's ``__metadata__`` as docs/api.md lays the format out (no safetensors library, no project codec)."""
    import struct

    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size])["__metadata__"]


def test_a_hand_built_payload_as_the_docs_describe_it_is_accepted(video_server):
    import httpx

    from app.core.codec import read_metadata

    rng = np.random.default_rng(0)
    bf16 = lambda a: (a.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()  # noqa: E731 (truncated)
    latents = rng.standard_normal((1, 128, 5, 4, 4))
    body = raw_safetensors({
        "latents": ("BF16", latents.shape, bf16(latents)),
        "prompt_embeds": ("F32", (1, 6, 32), rng.standard_normal((1, 6, 32)).astype("<f4").tobytes()),
        "prompt_attention_mask": ("BOOL", (1, 6), bytes([1, 1, 1, 1, 0, 0])),
    }, pad=5)
    octet = {"content-type": "application/octet-stream"}
    with httpx.Client(base_url=video_server.base_url, timeout=60) as http:
        session = http.post("/v1/sessions", json={}).json()["session_id"]
        first = http.post(f"/v1/sessions/{session}/chunks", content=body, headers=octet)
        assert first.status_code == 200, first.text
        # Every unit says its chunk's seq and its latency_ms (a string, like every metadata value).
        metadata = raw_metadata(first.content)
        assert (metadata["frame_start"], metadata["frame_end"], metadata["seq"]) == ("0", "4", "0")
        assert float(metadata["latency_ms"]) > 0
        # An empty body without flush=true is refused, saying what to send instead.
        refused = http.post(f"/v1/sessions/{session}/chunks", content=b"", headers=octet)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_payload"
        assert "flush=true" in refused.json()["error"]["message"]
        # A flush without new frames: an empty body with flush=true (or latents of 0 frames, api.md).
        flushed = http.post(f"/v1/sessions/{session}/chunks", params={"flush": "true"}, content=b"", headers=octet)
        assert flushed.status_code == 200, flushed.text
        metadata = raw_metadata(flushed.content)
        assert (metadata["frame_start"], metadata["frame_end"], metadata["seq"]) == ("4", "5", "1")
        assert float(metadata["latency_ms"]) > 0
        # The stream's units say the same: the seq of the message that finalized them (the flush counts).
        from websockets.sync.client import connect

        session = http.post("/v1/sessions", json={}).json()["session_id"]
        with connect(f"{video_server.ws_url}/v1/sessions/{session}/stream", max_size=None) as ws:
            ws.send(body)
            ws.send(json.dumps({"type": "flush"}))
            units = [raw_metadata(message) for message in ws if isinstance(message, bytes)]
        assert [(m["frame_start"], m["frame_end"], m["seq"]) for m in units] == [("0", "1", "0"), ("1", "4", "0"),
                                                                                 ("4", "5", "1")]
        assert all(float(m["latency_ms"]) > 0 for m in units)
    example = raw_safetensors({"prompt_attention_mask": ("I64", (1, 2), np.ones(2, "<i8").tobytes())})
    assert json.loads(example[8:-16]) == {"prompt_attention_mask": {"dtype": "I64", "shape": [1, 2],
                                                                    "data_offsets": [0, 16]}}
