"""examples/lmbenchmark/run.sh: what can be checked without an LMBenchmark checkout.

LMBenchmark is not on PyPI and no checkout is part of this repository, so no
test runs it; these run the real script up to the point where it would need
the checkout or start a server, and check that it stops there loudly, with a
message that says what to do, that the sizes and server command it would use
fit this machine, and that its core check refuses servers that ran on
different cores (real `vllm serve` log lines in tests/data).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "lmbenchmark" / "run.sh"


def run(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "LMBENCHMARK_DIR",
            "VLLM",
            "CLIENT_PYTHON",
            "OUT",
            "CHAT_HISTORY",
            "HOST_CACHE",
            "KV_CACHE_BYTES",
            "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CPU_NUM_OF_RESERVED_CPU",
        )
    }
    full_env.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def vllm_stub(base: Path) -> Path:
    """An executable standing in for vllm that notes any call: the tests that
    stop before a server starts run without the repository's .venv (CI's
    clean clone has .ci-venv) and prove nothing was started."""
    stub = base / "vllm-stub"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {base / "vllm-called"}\nexit 1\n')
    stub.chmod(0o755)
    return stub


def fake_checkout(base: Path, client: str = 'raise SystemExit("not the real client")\n'):
    qa = base / "synthetic-multi-round-qa"
    qa.mkdir(parents=True)
    (qa / "multi-round-qa.py").write_text(client)
    return base


def test_script_parses():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_no_model_prints_usage():
    out = run(cwd=ROOT)
    assert out.returncode == 2
    assert "usage:" in out.stderr and "MODEL" in out.stderr


def test_missing_lmbenchmark_dir_fails_with_how_to_get_it(tmp_path):
    out = run("some-model", cwd=tmp_path)
    assert out.returncode == 1
    assert "LMBENCHMARK_DIR is not set" in out.stderr
    assert "LMCache/LMBenchmark" in out.stderr and "git clone" in out.stderr
    assert not (tmp_path / "lmbenchmark-results").exists()  # nothing started


def test_relative_lmbenchmark_dir_that_does_not_exist_names_the_resolved_path(tmp_path):
    out = run("some-model", cwd=tmp_path, LMBENCHMARK_DIR="nowhere/LMBenchmark")
    assert out.returncode == 1
    assert f"no such directory ({tmp_path}/nowhere/LMBenchmark)" in out.stderr


def test_relative_dir_that_is_not_a_checkout_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    out = run("some-model", cwd=tmp_path, LMBENCHMARK_DIR="empty")
    assert out.returncode == 1
    assert (
        f"{tmp_path}/empty is not an LMBenchmark checkout: "
        f"{tmp_path}/empty/synthetic-multi-round-qa/multi-round-qa.py not found" in out.stderr
    )


def test_relative_checkout_is_accepted_then_a_missing_vllm_is_named(tmp_path):
    fake_checkout(tmp_path / "lmb")
    out = run("some-model", cwd=tmp_path, LMBENCHMARK_DIR="./lmb", VLLM=str(tmp_path / "no-vllm"))
    assert out.returncode == 1
    assert f"vllm not found at {tmp_path}/no-vllm" in out.stderr


def test_missing_client_requirements_fail_loudly_without_installing(tmp_path):
    """A python without LMBenchmark's imports: with INSTALL_CLIENT_DEPS=0 the
    script names what is missing instead of running a client that cannot
    write its CSV."""
    fake_checkout(tmp_path / "lmb")
    bare = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = run(
        "some-model",
        cwd=tmp_path,
        LMBENCHMARK_DIR="lmb",
        INSTALL_CLIENT_DEPS="0",
        CLIENT_PYTHON=str(bare / "bin" / "python"),
        VLLM=str(vllm_stub(tmp_path)),
    )
    assert out.returncode == 1
    assert not (tmp_path / "vllm-called").exists()
    assert "LMBenchmark's client needs openai pandas" in out.stderr
    assert str(bare / "bin" / "python") in out.stderr


def test_a_client_that_cannot_start_stops_the_run_before_any_server(tmp_path):
    """With its imports present, a client that fails (here: a checkout whose
    client exits with an error) stops the run with its last line, and no
    server is started."""
    fake_checkout(tmp_path / "lmb", 'raise SystemExit("client broken: no utils.py")\n')
    venv = tmp_path / "client-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # a python whose "openai" and "pandas" exist (empty packages): the script's
    # import check passes, and the client itself is what fails
    site = next((venv / "lib").glob("python3*/site-packages"))
    for name in ("openai", "pandas"):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("")
    out = run(
        "some-model",
        cwd=tmp_path,
        LMBENCHMARK_DIR="lmb",
        OUT="res",
        CLIENT_PYTHON=str(venv / "bin" / "python"),
        VLLM=str(vllm_stub(tmp_path)),
    )
    assert out.returncode == 1
    assert not (tmp_path / "vllm-called").exists()
    assert "LMBenchmark's client does not start" in out.stderr
    assert "client broken: no utils.py" in out.stderr
    assert (tmp_path / "res" / "client-check.log").exists()
    assert not list((tmp_path / "res").glob("server-*.log"))


def test_sizes_fit_the_machine_and_the_server_binds_localhost(tmp_path):
    out = run("--sizes", "my-model", "0.1", "0.5", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    server = next(line for line in text.splitlines() if line.startswith("server: "))
    assert server.startswith(f"server: {ROOT}/.venv/bin/vllm serve my-model ")
    assert "--host 127.0.0.1 " in server and "0.0.0.0" not in text
    assert "QPS=0.1 0.5" in text
    history = int(re.search(r"CHAT_HISTORY=(\d+)", text).group(1))
    host_gib = int(re.search(r"HOST_CACHE=(\d+)GiB", text).group(1))
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert 1 <= host_gib <= min(16, max(1, mem_gib / 4))
    assert history <= 20000
    max_len = int(re.search(r"--max-model-len (\d+)", server).group(1))
    assert max_len > history + 1000
    if "no GPU" in text:
        # CPU: histories scale with the cores, the engine KV cache is sized
        assert history == min(20000, 1000 * os.cpu_count())
        kv = int(re.search(r"--kv-cache-memory-bytes (\d+)", server).group(1))
        assert 0 < kv < host_gib * 2**30
    assert f"results: {tmp_path}/lmbenchmark-results" in text


def test_sizes_follow_the_environment(tmp_path):
    out = run(
        "--sizes",
        "m",
        cwd=tmp_path,
        CHAT_HISTORY="1234",
        HOST_CACHE="3GiB",
        KV_CACHE_BYTES="1000000",
        NUM_USERS="3",
        NUM_ROUNDS="5",
        OUT="rel/out",
    )
    assert out.returncode == 0, out.stderr
    assert "CHAT_HISTORY=1234" in out.stdout and "NUM_USERS=3 NUM_ROUNDS=5" in out.stdout
    assert "HOST_CACHE=3GiB KV_CACHE_BYTES=1000000" in out.stdout
    assert "--kv-cache-memory-bytes 1000000" in out.stdout
    # 1000 + 1234 + 5 * (100 + 40) + 256
    assert "--max-model-len 3190" in out.stdout
    assert f"results: {tmp_path}/rel/out" in out.stdout


DATA = ROOT / "tests" / "data"


def test_check_cores_refuses_servers_on_different_cores():
    """Real logs: by default vLLM CPU ran the plain server on core 0 and the
    KVBM server on cores 0 and 1."""
    out = run(
        "--check-cores",
        str(DATA / "vllm-serve-plain-auto.log"),
        str(DATA / "vllm-serve-kvbm-auto.log"),
        cwd=ROOT,
    )
    assert out.returncode == 1
    assert "vllm-serve-plain-auto.log: rank 0 cores [0]\n" in out.stdout
    assert "vllm-serve-kvbm-auto.log: rank 0 cores [0, 1]\n" in out.stdout
    assert "not run on the same cores" in out.stderr
    fair = run(
        "--check-cores",
        str(DATA / "vllm-serve-plain-auto.log"),
        str(DATA / "vllm-serve-kvbm-reserved1.log"),
        cwd=ROOT,
    )
    assert fair.returncode == 0, fair.stderr
    missing = run(
        "--check-cores", str(DATA / "vllm-serve-plain-auto.log"), str(ROOT / "README.md"), cwd=ROOT
    )
    assert missing.returncode == 1 and "README.md: unknown" in missing.stdout


def test_both_servers_get_the_same_binding_env(tmp_path):
    out = run("--sizes", "m", cwd=tmp_path)
    assert (
        "cpu binding (both servers): VLLM_CPU_OMP_THREADS_BIND=auto "
        "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in out.stdout
    )
    mine = run("--sizes", "m", cwd=tmp_path, VLLM_CPU_OMP_THREADS_BIND="0-1")
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=vLLM default" in mine.stdout
