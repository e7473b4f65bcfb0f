"""How the release check gets other vLLM releases' sources (vllm_kvbm/tools/vllm_wheels.py):
the remote-zip reader against a local HTTP server that speaks range requests,
PyPI's index (cached for when there is no network) and the releases read from it.
"""

from __future__ import annotations

import http.server
import os
import re
import threading
import zipfile
from pathlib import Path

import pytest

from vllm_kvbm.tools import vllm_wheels as wheels


# ---- the remote-zip reader -------------------------------------------------------


class _ZipServer:
    """Serves files over HTTP/1.1 with (or without) range requests; counts requests."""

    def __init__(self, root: Path, ranges: bool = True):
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append(self.headers.get("Range", "full"))
                path = root / self.path.lstrip("/")
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
                if ranges and m:
                    start, end = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
                    body = data[start : end + 1]
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                else:
                    body = data
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def wheel(tmp_path, monkeypatch):
    """A 3 MiB wheel-like zip (stored and deflated members, padding that makes
    a range reader matter) served over HTTP; the cache in tmp_path."""
    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "cache"))
    served = tmp_path / "srv"
    served.mkdir()
    path = served / "vllm-0.33.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/padding.bin", os.urandom(3 << 20), zipfile.ZIP_STORED)
        zf.writestr(
            wheels.BASE_MEMBER, "class KVConnectorBase_V1:\n    pass\n", zipfile.ZIP_DEFLATED
        )
        zf.writestr("vllm/other.py", "x = 1\n", zipfile.ZIP_DEFLATED)
    server = _ZipServer(served)
    release = wheels.Release("0.33.9", path.name, f"{server.url}/{path.name}", path.stat().st_size)
    yield server, release, path
    server.close()


def test_reader_fetches_only_the_members_and_caches_them(wheel, tmp_path):
    server, release, path = wheel
    remote = wheels.RemoteFile(release.url, release.size)
    with zipfile.ZipFile(remote) as zf:
        assert zf.read("vllm/other.py") == b"x = 1\n"
    assert remote.bytes_fetched < path.stat().st_size // 4  # not the padding

    out = wheels.release_sources(release, [wheels.BASE_MEMBER, "vllm/other.py"])
    assert out[wheels.BASE_MEMBER].startswith("class KVConnectorBase_V1")
    cached = tmp_path / "cache" / "vllm-wheels" / release.wheel / wheels.BASE_MEMBER
    assert cached.read_text() == out[wheels.BASE_MEMBER]
    n = len(server.requests)
    assert all(r != "full" for r in server.requests)
    assert wheels.release_sources(release, [wheels.BASE_MEMBER, "vllm/other.py"]) == out
    assert len(server.requests) == n  # served from the cache


def test_reader_optional_members_and_missing_ones(wheel):
    _, release, _ = wheel
    assert wheels.release_sources(release, ["vllm/absent.py"], optional=True) == {}
    with pytest.raises(wheels.FetchError, match="has no vllm/absent.py: vLLM moved it"):
        wheels.release_sources(release, ["vllm/absent.py"])


def test_reader_detects_a_corrupt_member(wheel):
    server, release, path = wheel
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("vllm/other.py")
    # Flip a byte of that member's (deflated) data: its CRC-32 no longer matches.
    header_end = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[header_end] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(wheels.FetchError, match="other.py is corrupt"):
        wheels.release_sources(release, ["vllm/other.py"])


def test_reader_refuses_a_server_without_ranges(tmp_path, wheel):
    _, release, path = wheel
    plain = _ZipServer(path.parent, ranges=False)
    try:
        with pytest.raises(wheels.FetchError, match="ignores range requests"):
            wheels.RemoteFile(f"{plain.url}/{path.name}")
    finally:
        plain.close()


def test_http_error_is_a_failure_not_offline(wheel):
    server, _, _ = wheel
    with pytest.raises(wheels.FetchError, match="HTTP 404") as err:
        wheels.RemoteFile(f"{server.url}/nope.whl")
    assert not isinstance(err.value, wheels.Offline)


def test_no_network_uses_the_cached_index_or_says_offline(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "cache"))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(wheels, "INDEX_URL", f"http://127.0.0.1:{port}/simple/vllm/")
    with pytest.raises(wheels.Offline, match="no answer"):
        wheels.fetch_index()
    cached = tmp_path / "cache" / "vllm-index.json"
    cached.parent.mkdir(parents=True)
    cached.write_text('{"files": []}')
    index, source = wheels.fetch_index()
    assert index == {"files": []} and "PyPI unreachable" in source


def test_list_releases_keeps_final_releases_in_range():
    def wheel(name, yanked=False):
        return {"filename": name, "url": f"https://x/{name}", "size": 1, "yanked": yanked}

    index = {
        "files": [
            wheel("vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl"),
            wheel("vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
            {"filename": "vllm-0.32.0.tar.gz", "url": "https://x/s", "size": 1},
            wheel("vllm-0.33.0rc1-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.33.1-cp38-abi3-manylinux_2_28_x86_64.whl", yanked=True),
            wheel("vllm-0.34.2-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
        ]
    }
    releases = wheels.list_releases(index)
    assert [r.version for r in releases] == ["0.32.0", "0.34.2"]
    assert all(r.wheel.endswith("x86_64.whl") for r in releases)


def test_list_releases_reads_wheel_names_by_pep_427():
    """packaging's parse_wheel_filename: a build tag, a post release and a
    non-normalized project name are read; local versions (+cu126) and files
    that are not wheels are left out."""

    def wheel(name):
        return {"filename": name, "url": f"https://x/{name}", "size": 1}

    index = {
        "files": [
            wheel("vLLM-0.32.1-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.33.0-1-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.33.0.post1-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.34.0+cu126-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.34.0.dev3-cp38-abi3-manylinux_2_28_x86_64.whl"),
            wheel("vllm-0.34.1-cp38-abi3-manylinux_2_28_x86_64.whl.metadata"),
            wheel("vllm_cpu-0.34.1-cp38-abi3-manylinux_2_28_x86_64.whl"),
        ]
    }
    assert [r.version for r in wheels.list_releases(index)] == ["0.32.1", "0.33.0", "0.33.0.post1"]
