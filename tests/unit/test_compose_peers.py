"""examples/peers: two engines that read each other's pools, found through a
peer directory in Redis, behind an nginx round-robin router.

Rendered by `docker compose config` (no Docker engine needed) with
.env.example's values, as helpers/compose.py renders the main stack; the
engines' kv-transfer-config goes through the connector's own load_config.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import ROOT
from helpers.compose import dotenv, resolved

pytestmark = pytest.mark.timeout(120)

EXAMPLE = ROOT / "examples" / "peers"
ENGINES = ("engine-a", "engine-b")
MIDDLEWARE = "vllm_kvbm.serve_middleware.check_kv_transfer_params"


def compose() -> list[str]:
    """The compose CLI; skipped without it, except under CI."""
    from helpers.compose import compose_command

    try:
        return compose_command()
    except pytest.fail.Exception as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"docker compose v2 is not installed ({err}); scripts/setup.sh installs it")


def render(*files: str, **env) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if k not in dotenv() and not k.startswith("COMPOSE_")
    }
    args = [a for f in files or ("docker-compose.yml",) for a in ("-f", str(EXAMPLE / f))]
    return subprocess.run(
        [*compose(), *args, "--env-file", ".env.example", "config", "--format", "json"],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def peers(*files: str, **env) -> dict:
    """The resolved example (a fresh copy: callers may change it)."""
    return json.loads(_rendered(files, tuple(sorted(env.items()))))


@functools.lru_cache
def _rendered(files: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> str:
    proc = render(*files, **dict(env))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def extra_config(svc: dict) -> dict:
    command = svc["command"]
    return json.loads(command[command.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"
    ]


def engine_config(config: dict, name: str, folder: Path):
    """What the connector reads in NAME's container: its extra config over its
    environment, the secret files and the pool's tmpfs standing in as files
    and a folder of this machine."""
    from vllm_kvbm.config import load_config

    svc = config["services"][name]
    kv = extra_config(svc)
    mounts = {v["target"]: v for v in svc["volumes"]}
    pool = mounts[kv["pool_dir"]]
    assert pool["type"] == "volume", pool
    assert config["volumes"][pool["source"]]["driver_opts"]["type"] == "tmpfs"
    environ = dict(svc["environment"])
    for key, value in environ.items():
        if value.startswith("/run/secrets/"):
            secret = Path(value).name
            assert secret in [s["source"] for s in svc["secrets"]], (name, secret)
            stand_in = folder / secret
            stand_in.write_text("0123456789abcdef" * 4)
            environ[key] = str(stand_in)
    (folder / name).mkdir()
    return load_config({**kv, "pool_dir": str(folder / name)}, environ=environ), pool["source"]


def test_the_example_renders_two_peers_a_directory_and_a_router(tmp_path):
    config = peers()
    assert set(config["services"]) == {*ENGINES, "redis", "router"}
    configs = {}
    pools = set()
    for name in ENGINES:
        svc = config["services"][name]
        assert svc["command"][:3] == ["vllm", "serve", dotenv()["MODEL"]]
        assert svc["command"][svc["command"].index("--middleware") + 1] == MIDDLEWARE
        assert svc["build"] == {"context": str(ROOT), "dockerfile": "Dockerfile"}
        assert svc["image"] == "vllm-kvbm:local"  # the main stack's CPU image
        cfg, pool = engine_config(config, name, tmp_path)
        configs[name] = cfg
        pools.add(pool)
        assert cfg.peer_reads is True
        assert cfg.pool_cache_bytes and cfg.pool_serve_port == 7300
        # it binds, and lists in the directory, its own name on the stack's network
        assert cfg.pool_serve_host == name
        # the directory is the stack's Redis, behind the password from its secret
        assert re.fullmatch(r"redis://redis:6379(/\d+)?", cfg.peer_directory_url)
        assert cfg.remote_password is not None and cfg.page_secret is not None
        # no shared tier other than the peers': a second engine's hit is a peer read
        assert cfg.disk_cache_dir is None and cfg.remote_url is None
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    a, b = configs.values()
    assert a.namespace == b.namespace != ""
    assert a.page_secret.source == b.page_secret.source
    # each engine keeps a pool of its own: one shared file would be a pool hit, not a peer's
    assert len(pools) == 2


def test_the_router_round_robins_over_both_engines():
    config = peers()
    router = config["services"]["router"]
    assert re.fullmatch(r"nginx:\d+\.\d+\.\d+-alpine", router["image"]), router["image"]
    [mount] = router["volumes"]
    assert mount["target"] == "/etc/nginx/nginx.conf" and mount["read_only"] is True
    text = Path(mount["source"]).read_text()
    upstream = re.search(r"upstream engines \{(.*?)\}", text, re.S).group(1)
    servers = re.findall(r"^\s*server\s+(\S+);", upstream, re.M)
    ports = {name: 8000 for name in ENGINES}
    assert servers == [f"{n}:{p}" for n, p in ports.items()]
    # round-robin: no hash, no least_conn, no sticky choice of an engine
    assert not re.search(r"\b(hash|ip_hash|least_conn|random|sticky)\b", upstream)
    # one worker process: one round-robin turn, so requests alternate engines
    assert re.search(r"^worker_processes 1;", text, re.M)
    assert "proxy_pass http://engines;" in text
    for name in ENGINES:
        assert router["depends_on"][name]["condition"] == "service_healthy"
        assert "8000" in config["services"][name]["expose"]
    [port] = router["ports"]
    assert port["target"] == 8080 and f"listen {port['target']};" in text
    check = " ".join(router["healthcheck"]["test"])
    assert "/router-health" in check and "location = /router-health" in text


def test_only_the_router_is_published_on_loopback_unless_opened():
    assert dotenv()["KVBM_BIND_ADDR"] == "127.0.0.1"
    for env, ip in (({}, "127.0.0.1"), ({"KVBM_BIND_ADDR": "0.0.0.0"}, "0.0.0.0")):
        for files in (("docker-compose.yml",), ("docker-compose.yml", "cuda.yml")):
            services = peers(*files, **env)["services"]
            published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
            assert list(published) == ["router"], (files, published)
            assert [p["host_ip"] for p in published["router"]] == [ip], (files, env)


def test_the_directory_needs_the_password_from_the_secret_file():
    config = peers()
    main = resolved()["services"]["redis"]
    redis = config["services"]["redis"]
    assert config["secrets"]["redis_password"]["file"] == str(ROOT / "secrets" / "redis_password")
    assert config["secrets"]["kvbm_page_secret"]["file"] == str(
        ROOT / "secrets" / "kvbm_page_secret"
    )
    assert [s["source"] for s in redis["secrets"]] == ["redis_password"]
    # the main stack's script: the password on redis-server's standard input,
    # never its command line or environment
    assert redis["command"][:4] == main["command"][:4]
    script = redis["command"][2].replace("$$", "$")
    assert "pw=$(cat /run/secrets/redis_password)" in script
    assert "<<EOF\nrequirepass $pw\nEOF" in script
    assert "environment" not in redis
    assert redis["healthcheck"] == main["healthcheck"]
    password = ROOT / "secrets" / "redis_password"
    secret = password.read_text().strip() if password.is_file() else None
    assert not {"--requirepass", "-a", "--pass"} & set(redis["command"][3:])
    for name, svc in config["services"].items():
        if name != "redis":
            assert "requirepass" not in " ".join(svc.get("command") or []), name
        if secret:
            assert secret not in json.dumps(svc), name
    # bounded as the main stack's: maxmemory, LRU, inside a container limit without swap
    flags = redis["command"][4:]
    options = dict(zip(flags[::2], flags[1::2]))
    assert options["--maxmemory-policy"] == "allkeys-lru"
    assert int(redis["mem_limit"]) == int(redis["memswap_limit"])
    maxmemory = int(re.fullmatch(r"(\d+)mb", options["--maxmemory"]).group(1)) << 20
    assert maxmemory <= 0.8 * int(redis["mem_limit"])


def test_every_service_logs_to_a_rotated_file_and_the_small_ones_are_capped():
    env = dotenv()
    services = peers()["services"]
    for name, svc in services.items():
        assert svc["logging"] == {
            "driver": "json-file",
            "options": {"max-size": env["LOG_MAX_SIZE"], "max-file": env["LOG_MAX_FILES"]},
        }, name
        assert svc["restart"] == "unless-stopped", name
        assert svc["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in ("redis", "router"):
        assert int(services[name]["mem_limit"]) == int(services[name]["memswap_limit"]) > 0
    services = peers(LOG_MAX_SIZE="10m")["services"]
    assert {svc["logging"]["options"]["max-size"] for svc in services.values()} == {"10m"}


def test_the_engines_match_the_main_stacks_vllm_where_copied():
    main = resolved()["services"]["vllm"]
    for name in ENGINES:
        svc = peers()["services"][name]
        assert svc["healthcheck"] == main["healthcheck"], name
        for key in ("shm_size", "cap_add", "security_opt"):
            assert svc[key] == main[key], (name, key)
        mounts = {v["target"]: v["source"] for v in svc["volumes"]}
        main_mounts = {v["target"]: v["source"] for v in main["volumes"]}
        for target in ("/home/kvbm/.cache/huggingface", "/kvbm-cache", "/models"):
            assert mounts[target].rsplit("/", 1)[-1] == main_mounts[target].rsplit("/", 1)[-1]
        for key in ("KVBM_PAGE_SECRET_FILE", "KVBM_REMOTE_PASSWORD_FILE", "KVBM_CACHE_DIR"):
            assert svc["environment"][key] == main["environment"][key], (name, key)


def test_the_cuda_file_puts_each_engine_on_its_own_gpu():
    config = peers("docker-compose.yml", "cuda.yml")
    gpus = []
    for name in ENGINES:
        svc = config["services"][name]
        assert svc["build"] == {"context": str(ROOT), "dockerfile": "Dockerfile.cuda"}
        assert svc["ipc"] == "host"
        # the CPU backend's settings are gone
        assert not {"shm_size", "cap_add", "security_opt"} & {k for k, v in svc.items() if v}
        [devices] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in devices  # Docker would hand both engines the first GPU
        gpus += devices["device_ids"]
        # the peer settings are the CPU file's
        assert extra_config(svc) == extra_config(peers()["services"][name])
    assert gpus == ["0", "1"]
    config = peers("docker-compose.yml", "cuda.yml", ENGINE_A_GPU="2", ENGINE_B_GPU="3")
    assert [
        config["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for n in ENGINES
    ] == [["2"], ["3"]]


def test_the_example_is_linked_from_the_docs():
    for doc in ("peer-tier.md", "deployment.md"):
        assert "../examples/peers/" in (ROOT / "docs" / doc).read_text(), doc
    readme = (EXAMPLE / "README.md").read_text()
    assert "kvbm_matched_tokens_total{" in readme and 'tier="peer"' in readme
    assert "docker compose -f examples/peers/docker-compose.yml" in readme
