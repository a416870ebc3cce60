"""vLLM's `--ssl-certfile` / `--ssl-keyfile` (uvicorn's TLS) on one real `loraplex serve`: the API answers over
HTTPS with the given certificate and refuses plain HTTP; bad files stop the start-up before the model loads. The
self-signed certificate is made with the `openssl` command (skipped where there is none)."""
from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from gateway_server import ServerProcess, loraplex_command
from testlib import model_dir

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_https_with_the_given_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    proc = ServerProcess(model_dir("llama_gqa"), "--max-model-len", "128", "--served-model-name", "tiny",
                         "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    try:
        assert proc.url.startswith("https://")
        with httpx.Client(base_url=proc.url, verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as client:
            resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):
            httpx.get(proc.url.replace("https://", "http://") + "/health", timeout=5)
        assert f"https://127.0.0.1:{proc.port}" in proc.output()   # the banner names the https URL
    finally:
        proc.stop()


@pytest.mark.parametrize("flags, needle", [
    (["--ssl-certfile", "/no/such/cert.pem"], "cannot load"),
    (["--ssl-keyfile", "/k.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs needs --ssl-certfile"),
])
def test_bad_tls_flags_stop_the_start_up_at_once(flags: list[str], needle: str) -> None:
    out = subprocess.run([*loraplex_command(), "serve", "--model", str(model_dir("llama_gqa")), "--port", "0", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_a_key_that_does_not_match_is_refused(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_key = self_signed(tmp_path / "other")
    out = subprocess.run([*loraplex_command(), "serve", "--model", str(model_dir("llama_gqa")), "--port", "0",
                          "--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot load" in out.stderr, out.stderr
