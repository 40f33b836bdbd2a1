"""`ditsp serve` without a token (issue 44 item 3): requests whose Host is not the server's (DNS rebinding)
and cross-origin requests from web pages are refused; `--allow-host` and `--allow-origin` let chosen ones in.
A real server on 127.0.0.1 without workers (requests are refused before any worker could see them)."""

from __future__ import annotations

import httpx
import pytest

from ditsp.cli import main
from ditsp.serve import Settings

from .test_serve_reliability import Server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def srv(tmp_path):
    with Server(Settings(data_dir=str(tmp_path / "data"))) as s:
        yield s


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


def test_a_rebound_name_is_refused(srv):
    """A page on evil.example whose name now resolves to 127.0.0.1 sends ``Host: evil.example:<port>``:
    it may neither list jobs nor submit one (before: 200 and 201)."""
    port = port_of(srv.url)
    with httpx.Client(base_url=srv.url, timeout=20) as c:
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
            r = c.get("/v1/jobs", headers={"Host": host})
            assert r.status_code == 400 and "not a name of this server" in r.json()["detail"], (host, r.text)
            r = c.post("/v1/jobs", headers={"Host": host}, files={"file": ("x.mp4", b"0" * 100)})
            assert r.status_code == 400 and "--allow-host" in r.json()["detail"], (host, r.text)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "localhost."):
            assert c.get("/v1/jobs", headers={"Host": host}).status_code == 200, host


def test_a_cross_origin_post_is_refused(srv):
    """A web page's form or fetch POST carries its Origin (or Sec-Fetch-Site): refused (before: a job was
    accepted from any page); the server's own origin and clients without one (curl, scripts) pass."""
    port = port_of(srv.url)
    with httpx.Client(base_url=srv.url, timeout=20) as c:
        upload = {"file": ("x.mp4", b"0" * 100)}
        for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"},
                        {"Origin": f"http://localhost:{int(port) + 1}"}, {"Sec-Fetch-Site": "cross-site"}):
            r = c.post("/v1/jobs", headers=headers, files=upload)
            assert r.status_code == 403 and "cross-origin" in r.json()["detail"], (headers, r.text)
            assert c.get("/v1/jobs", headers=headers).status_code == 403, headers
        same = c.post("/v1/jobs", headers={"Origin": f"http://127.0.0.1:{port}"}, files=upload)
        assert same.status_code == 400 and "cannot be read" in same.json()["detail"]  # past the guard
        assert c.post("/v1/jobs", files=upload).status_code == 400  # no Origin: not a browser


def test_allowed_hosts_and_origins(tmp_path):
    settings = Settings(data_dir=str(tmp_path / "data"), allow_hosts=["render.lan"],
                        allow_origins=["https://app.example:8443/"])
    with Server(settings) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
        assert c.get("/v1/jobs", headers={"Host": "render.lan:80"}).status_code == 200
        assert c.get("/v1/jobs", headers={"Host": "other.lan"}).status_code == 400
        ok = c.get("/v1/jobs", headers={"Origin": "https://app.example:8443"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example:8443"
        pre = c.options("/v1/jobs", headers={"Origin": "https://app.example:8443", "Access-Control-Request-Method":
                                             "POST", "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200, pre.text
        assert c.get("/v1/jobs", headers={"Origin": "https://app.example"}).status_code == 403  # another port
    with Server(Settings(data_dir=str(tmp_path / "d2"), allow_hosts=["*"])) as srv, \
            httpx.Client(base_url=srv.url, timeout=20) as c:
        assert c.get("/v1/jobs", headers={"Host": "anything.example"}).status_code == 200


def test_a_wildcard_address_takes_any_host_name():
    assert Settings(data_dir="x", host="0.0.0.0").host_names() is None
    assert Settings(data_dir="x", host="192.0.2.7").host_names() == {"192.0.2.7"}
    assert {"localhost", "127.0.0.1", "::1"} <= Settings(data_dir="x").host_names()


@pytest.mark.parametrize("flag,value", [("--allow-host", "evil.example:80"), ("--allow-host", "a/b"),
                                        ("--allow-origin", "null"), ("--allow-origin", "app.example"),
                                        ("--allow-origin", "https://app.example/path")])
def test_bad_allow_values_are_refused_in_one_line(tmp_path, capsys, flag, value):
    assert main(["serve", "--port", "0", "--data-dir", str(tmp_path / "d"), flag, value]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ditsp serve: error: {flag}") and "\n" not in err, err
    assert not (tmp_path / "d").exists()  # refused before the data dir is made
