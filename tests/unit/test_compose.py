"""docker-compose.yml, its .env.example, the Grafana provisioning and the images.

No Docker engine runs here: `docker compose config` (Compose v2, installed by
scripts/setup_tools.sh) validates and resolves the file without one, and the checks
read its resolved JSON (helpers/compose.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import ROOT
from helpers.compose import dotenv, resolved

pytestmark = pytest.mark.timeout(120)

SERVICES = {"vllm", "prometheus", "grafana", "redis"}
MIDDLEWARE = "vllm_kvbm.serve_middleware.check_kv_transfer_params"


def kv_transfer_config(command: list[str]) -> dict:
    return json.loads(command[command.index("--kv-transfer-config") + 1])


def in_container(environment: dict, folder: Path) -> dict:
    """A vLLM service's environment as the connector reads it in its container,
    here: the secret files compose mounts at /run/secrets/<name> stand in as
    files of this machine (the secret as scripts/compose_secrets.sh writes it),
    the disk volume's path (which exists only in the container) left out."""
    environ = {k: v for k, v in environment.items() if v is not None}
    for key, value in environ.items():
        if value.startswith("/run/secrets/"):
            stand_in = folder / Path(value).name
            stand_in.write_text("0123456789abcdef" * 4)
            environ[key] = str(stand_in)
    environ["KVBM_DISK_CACHE_DIR"] = ""
    return environ


def test_compose_file_resolves_with_the_four_services():
    env = dotenv()
    config = resolved()
    assert set(config["services"]) == SERVICES

    vllm = config["services"]["vllm"]
    assert vllm["command"][:3] == ["vllm", "serve", env["MODEL"]]
    assert "KVBMConnector" in " ".join(vllm["command"])
    kv = kv_transfer_config(vllm["command"])
    assert kv["kv_connector"] == "KVBMConnector"
    assert kv["kv_connector_module_path"] == "vllm_kvbm.connector"
    assert kv["kv_connector_extra_config"] == {"host_cache_size": env["KVBM_HOST_CACHE_SIZE"]}
    from vllm_kvbm.config import load_config  # the plugin accepts that config

    load_config(kv["kv_connector_extra_config"], environ={})
    assert vllm["command"][vllm["command"].index("--port") + 1] == "8000"
    # a bad kv_transfer_params is a 400 naming the field, not a request served without KVBM
    assert vllm["command"][vllm["command"].index("--middleware") + 1] == MIDDLEWARE
    assert vllm["build"]["context"] == str(ROOT)
    assert (ROOT / vllm["build"]["dockerfile"]).is_file()
    assert {(p["target"], p["published"]) for p in vllm["ports"]} == {(8000, env["VLLM_PORT"])}

    grafana = config["services"]["grafana"]
    assert {(p["target"], p["published"]) for p in grafana["ports"]} == {(3000, "3001")}
    mounts = {v["target"]: v for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning["type"] == "bind"
    assert provisioning["source"] == str(ROOT / "grafana" / "provisioning")
    assert mounts["/var/lib/grafana/dashboards"]["source"] == str(ROOT / "grafana" / "dashboards")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/kvbm.json"

    prometheus = config["services"]["prometheus"]
    mounts = {v["target"]: v["source"] for v in prometheus["volumes"]}
    assert mounts["/etc/prometheus"] == str(ROOT / "deploy" / "prometheus")
    scrape = yaml.safe_load((Path(mounts["/etc/prometheus"]) / "prometheus.yml").read_text())
    targets = [
        t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    assert targets == ["vllm:8000"]
    # KVBM's alert rules, from the mounted directory (tests/unit/test_alert_rules.py)
    assert scrape["rule_files"] == ["kvbm-alerts.yml"]
    assert (Path(mounts["/etc/prometheus"]) / "kvbm-alerts.yml").is_file()


def test_prometheus_accepts_its_config_and_the_alert_rules():
    """promtool (Debian's prometheus package, scripts/setup_tools.sh) checks the
    config as the compose Prometheus reads it, the rule file it names included."""
    import shutil

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run scripts/setup_tools.sh")
    proc = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=ROOT / "deploy" / "prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rule files found" in proc.stdout and "kvbm-alerts.yml" in proc.stdout


def test_settings_come_from_the_environment_over_dotenv():
    config = resolved(MODEL="/models/my-model", KVBM_HOST_CACHE_SIZE="2GiB", GRAFANA_PORT="3002")
    command = config["services"]["vllm"]["command"]
    assert command[2] == "/models/my-model"
    assert kv_transfer_config(command)["kv_connector_extra_config"] == {"host_cache_size": "2GiB"}
    assert config["services"]["grafana"]["ports"][0]["published"] == "3002"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard():
    datasources = yaml.safe_load(
        (ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    [source] = datasources["datasources"]
    assert source["uid"] == "prometheus" and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/kvbm.yml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_dashboard_panels_all_have_a_datasource_and_queries():
    dashboard = json.loads((ROOT / "grafana/dashboards/kvbm.json").read_text())
    assert dashboard["uid"] == "kvbm"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_hard_codes_no_datasource_uid():
    """Importable into any Grafana: every datasource reference (panels, their
    targets, rows' nested panels, variables) goes through the `datasource`
    variable; the uid `prometheus` of the compose stack is only its default."""
    dashboard = json.loads((ROOT / "grafana/dashboards/kvbm.json").read_text())
    refs = []

    def walk(node, where):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "datasource":
                    refs.append((where, value))
                else:
                    walk(value, f"{where}/{node.get('title', node.get('name', key))}")
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    walk({k: v for k, v in dashboard.items() if k != "templating"}, "")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    walk([v for name, v in variables.items() if name != "datasource"], "templating")
    assert len(refs) >= 50
    bad = [
        (where, ref) for where, ref in refs if ref != {"type": "prometheus", "uid": "${datasource}"}
    ]
    assert not bad, bad

    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    # the compose stack's provisioned datasource (grafana/provisioning) is the default
    assert ds["current"]["value"] == "prometheus"
    [source] = yaml.safe_load(
        (ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    assert source["uid"] == ds["current"]["value"]
    # An import input must be used where it is declared: Grafana's import dialog
    # asks for each and substitutes ${NAME}; one no panel reads was asked for and
    # ignored. The datasource variable picks the Prometheus instead.
    text = (ROOT / "grafana/dashboards/kvbm.json").read_text()
    for inp in dashboard.get("__inputs", []):
        assert "${%s}" % inp["name"] in text.replace(json.dumps(inp), ""), inp
    assert {"type": "datasource", "id": "prometheus"}.items() <= next(
        r for r in dashboard["__requires"] if r["type"] == "datasource"
    ).items()


def test_image_default_command_serves_with_the_connector(tmp_path):
    """deploy/serve.sh (the Dockerfile's CMD) with a stand-in `vllm` that prints its args."""
    assert 'CMD ["bash", "deploy/serve.sh"]' in (ROOT / "Dockerfile").read_text()
    fake = tmp_path / "vllm"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "MODEL": "org/model",
        "KVBM_HOST_CACHE_SIZE": "3GiB",
        "VLLM_EXTRA_ARGS": "--enforce-eager --seed 1",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy/serve.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    args = json.loads(proc.stdout)
    assert args[:2] == ["serve", "org/model"]
    kv = kv_transfer_config(args)
    assert kv["kv_connector"] == "KVBMConnector"
    assert kv["kv_connector_extra_config"] == {"host_cache_size": "3GiB"}
    assert args[args.index("--middleware") + 1] == MIDDLEWARE
    assert args[-3:] == ["--enforce-eager", "--seed", "1"]


# ---- the CUDA profile ------------------------------------------------------------

CUDA_SERVICES = {"vllm-cuda", "prometheus", "grafana", "redis"}


def test_default_up_starts_the_cpu_vllm_only():
    assert dotenv()["COMPOSE_PROFILES"] == "cpu"
    assert set(resolved()["services"]) == SERVICES  # no vllm-cuda
    # with no profile at all, neither vLLM service (nor an LMCache server) starts
    assert set(resolved(COMPOSE_PROFILES="")["services"]) == {"prometheus", "grafana", "redis"}


def test_cuda_profile_replaces_the_cpu_vllm_and_shares_the_rest(tmp_path):
    env = dotenv()
    cpu = resolved()["services"]
    config = resolved("--profile", "cuda")
    assert set(config["services"]) == CUDA_SERVICES
    assert set(resolved(COMPOSE_PROFILES="cuda")["services"]) == CUDA_SERVICES
    cuda = config["services"]["vllm-cuda"]

    assert cuda["build"] == {"context": str(ROOT), "dockerfile": "Dockerfile.cuda"}
    assert (ROOT / "Dockerfile.cuda").is_file()
    assert cuda["image"] != cpu["vllm"]["image"]
    # one GPU per tensor-parallel rank, not every GPU of the machine
    assert cuda["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": int(env["TENSOR_PARALLEL_SIZE"]), "capabilities": ["gpu"]}
    ]
    assert cuda["ipc"] == "host"
    # the pinned host tier needs locked memory without a cap
    assert cuda["ulimits"] == {"memlock": -1}

    command = cuda["command"]
    assert command[:3] == ["vllm", "serve", env["MODEL"]]
    assert command[command.index("--middleware") + 1] == MIDDLEWARE
    assert command[command.index("--gpu-memory-utilization") + 1] == env["GPU_MEMORY_UTILIZATION"]
    assert command[command.index("--tensor-parallel-size") + 1] == env["TENSOR_PARALLEL_SIZE"]
    kv = kv_transfer_config(command)
    assert kv == kv_transfer_config(cpu["vllm"]["command"])
    from vllm_kvbm.config import load_config

    load_config(
        kv["kv_connector_extra_config"], environ=in_container(cuda["environment"], tmp_path)
    )

    # the same tiers, volumes and port as the CPU service; CPU-only settings left out
    cpu_env = dict(cpu["vllm"]["environment"])
    assert cpu_env.pop("VLLM_CPU_KVCACHE_SPACE") == env["VLLM_CPU_KVCACHE_SPACE"]
    assert cuda["environment"] == cpu_env
    assert cuda["environment"]["KVBM_REMOTE_URL"] == env["KVBM_REMOTE_URL"]
    assert cuda["volumes"] == cpu["vllm"]["volumes"]
    assert cuda["ports"] == cpu["vllm"]["ports"]
    assert cuda["healthcheck"] == cpu["vllm"]["healthcheck"]
    assert "lmcache-server-cuda" in cuda["depends_on"]
    assert not {"shm_size", "cap_add", "VLLM_CPU_KVCACHE_SPACE"} & set(cuda)

    # Prometheus scrapes vllm:8000 (deploy/prometheus/prometheus.yml): the CUDA
    # service answers to it
    assert "vllm" in cuda["networks"]["default"]["aliases"]
    assert config["services"]["prometheus"] == cpu["prometheus"]
    assert config["services"]["grafana"] == cpu["grafana"]
    assert config["services"]["redis"] == cpu["redis"]


def test_the_cuda_service_takes_as_many_gpus_as_tensor_parallel_ranks():
    for tp in ("2", "8"):
        cuda = resolved("--profile", "cuda", TENSOR_PARALLEL_SIZE=tp)["services"]["vllm-cuda"]
        [devices] = cuda["deploy"]["resources"]["reservations"]["devices"]
        assert devices["count"] == int(tp)
        assert cuda["command"][cuda["command"].index("--tensor-parallel-size") + 1] == tp


def test_each_profile_builds_only_its_own_image():
    """`--profile cuda` must not build the CPU image (vllm-cpu, a different
    torch) and the default must not build the CUDA one."""
    for args, dockerfile in (
        (("--profile", "cpu"), "Dockerfile"),
        (("--profile", "cuda"), "Dockerfile.cuda"),
        (("--profile", "cpu", "--profile", "lmcache"), "Dockerfile"),
        (("--profile", "cuda", "--profile", "lmcache-cuda"), "Dockerfile.cuda"),
        (("--profile", "cpu", "--profile", "pool"), "Dockerfile"),
        (("--profile", "cuda", "--profile", "pool-cuda"), "Dockerfile.cuda"),
    ):
        services = resolved(*args)["services"]
        built = {
            name: svc["build"].get("dockerfile", "Dockerfile")
            for name, svc in services.items()
            if "build" in svc
        }
        assert built and set(built.values()) == {dockerfile}, (args, built)
        images = {svc["image"] for svc in services.values() if "build" in svc}
        assert len(images) == 1, images  # an LMCache server, kvbm-pool reuse the vLLM image


def test_no_image_sets_a_kvbm_variable_that_would_clash_with_compose():
    """A KVBM_* variable that sets a key kv_connector_extra_config also sets, to
    another value, stops startup: an image-level ENV KVBM_HOST_CACHE_SIZE would
    clash with .env's size the moment the operator changed it."""
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / name).read_text()
        env_lines = " ".join(re.findall(r"^ENV .*?(?<!\\)$", text, re.M | re.S))
        assert not re.search(r"\b(KVBM|DYN_KVBM)_\w+=", env_lines), (name, env_lines)


@pytest.mark.parametrize("profile,service", [("cpu", "vllm"), ("cuda", "vllm-cuda")])
def test_the_connector_reads_the_sizes_dotenv_says(profile, service, tmp_path):
    """What the connector's config will hold in each profile's vLLM container:
    its kv_connector_extra_config overlaid with the container's environment
    (exactly what load_config does in the container), from .env's values."""
    from vllm_kvbm.config import load_config, parse_size

    env = dotenv()
    svc = resolved("--profile", profile)["services"][service]
    kv = kv_transfer_config(svc["command"])
    environ = in_container(svc["environment"], tmp_path)
    assert not {
        "KVBM_HOST_CACHE_SIZE",
        "KVBM_HOST_CACHE_GB",
        "DYN_KVBM_CPU_CACHE_GB",
        "KVBM_HOST_CACHE_BLOCKS",
    } & set(environ)
    config = load_config(kv["kv_connector_extra_config"], environ=environ)
    assert config.host_cache_bytes == parse_size("host", env["KVBM_HOST_CACHE_SIZE"])
    assert config.disk_cache_bytes == parse_size("disk", env["KVBM_DISK_CACHE_SIZE"])
    assert config.remote_url == env["KVBM_REMOTE_URL"] == "redis://redis:6379"
    assert svc["environment"]["KVBM_DISK_CACHE_DIR"] == "/kvbm-disk"
    # the Redis password and the page secret, read from the mounted secret files
    assert config.remote_password is not None and config.page_secret is not None
    assert {v["target"] for v in svc["volumes"]} >= {"/kvbm-disk"}


def test_cuda_image_installs_the_cuda_extra_and_the_matching_nixl():
    text = (ROOT / "Dockerfile.cuda").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M).group(1)
    # vLLM 0.32-0.34's wheels run on PyPI's PyTorch 2.13, built for CUDA 13
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-(runtime|devel)-ubuntu\d\d\.\d\d", base)
    assert "FROM ${CUDA_IMAGE}" in text
    assert 'pip install ".[cuda]"' in text
    # NIXL's meta package (both CUDA majors) comes with the package; the build
    # checks that PyTorch has CUDA and NIXL's build for its major is there
    assert "torch.version.cuda" in text and "md.version(nixl)" in text
    assert not re.search(r"pip install \S*nixl", text)
    assert 'CMD ["bash", "deploy/serve.sh"]' in text
    for path in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / path).exists(), path

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    assert "nixl" in deps and not {"nixl-cu12", "nixl-cu13"} & set(deps)
    [vllm] = [Requirement(r) for r in extras["cuda"]]
    assert vllm.name == "vllm"
    spec = SpecifierSet(str(vllm.specifier))
    assert "0.32.0" in spec and "0.35.0" not in spec and "0.31.0" not in spec


# ---- the pool profile -------------------------------------------------------------


@pytest.mark.parametrize(
    "profile,service,pool,pool_service",
    [("cpu", "vllm", "pool", "kvbm-pool"), ("cuda", "vllm-cuda", "pool-cuda", "kvbm-pool-cuda")],
)
def test_the_pool_profile_shares_its_files_with_vllm(
    profile, service, pool, pool_service, tmp_path
):
    """kvbm-pool and vLLM mount one tmpfs volume: the pool files and the
    socket; the engine's pool settings are off until KVBM_POOL_CACHE_SIZE is
    set, then they name that volume and that socket."""
    from vllm_kvbm.config import load_config
    from vllm_kvbm.tools.pool import main as pool_main

    config = resolved("--profile", profile, "--profile", pool)
    services = config["services"]
    kvbm_pool, vllm = services[pool_service], services[service]
    assert kvbm_pool["command"][0] == "kvbm-pool"
    assert vllm["depends_on"][pool_service]["required"] is False
    volume = config["volumes"]["kvbm-pool"]
    assert volume["driver_opts"]["type"] == "tmpfs"
    assert "size=8g" in volume["driver_opts"]["o"] and "uid=10001" in volume["driver_opts"]["o"]
    for svc in (kvbm_pool, vllm):
        assert {(v["source"], v["target"]) for v in svc["volumes"]} >= {("kvbm-pool", "/kvbm-pool")}
    args = kvbm_pool["command"][1:]
    assert args[args.index("--dir") + 1] == "/kvbm-pool"
    sock = args[args.index("--socket") + 1]
    assert kvbm_pool["healthcheck"]["test"] == ["CMD", "kvbm-pool", "--check", "--socket", sock]
    with pytest.raises(SystemExit) as done:  # the command line it runs parses
        pool_main([*args, "--help"])
    assert done.value.code == 0
    # off by default: the engine takes no pool
    kv = kv_transfer_config(vllm["command"])["kv_connector_extra_config"]
    off = load_config(kv, environ=in_container(vllm["environment"], tmp_path))
    assert off.pool_cache_bytes is None
    on = resolved("--profile", profile, "--profile", pool, KVBM_POOL_CACHE_SIZE="2GiB")["services"][
        service
    ]
    environ = in_container(on["environment"], tmp_path)
    environ["KVBM_POOL_DIR"] = str(tmp_path)  # /kvbm-pool exists in the container only
    cfg = load_config(kv, environ=environ)
    assert cfg.pool_cache_bytes == 2 << 30 and cfg.pool_socket == sock
    assert on["environment"]["KVBM_POOL_DIR"] == "/kvbm-pool"
