"""A real Prometheus (Debian's package, installed by scripts/setup.sh) for the
tests, on 127.0.0.1: it scrapes one target every second and loads KVBM's alert
rules (tests/e2e/test_prometheus_dashboard.py runs the dashboard's queries on it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers import ROOT
from vllm_kvbm.tools.server import free_port, wait_for_http


ALERT_RULES = ROOT / "deploy" / "prometheus" / "kvbm-alerts.yml"


class Prometheus:
    def __init__(self, workdir: Path, target: str):
        if shutil.which("prometheus") is None:
            pytest.fail(
                "prometheus is not installed: run scripts/setup.sh "
                "(it installs Debian's prometheus package)"
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {
                        "scrape_interval": "1s",
                        "scrape_timeout": "1s",
                        "evaluation_interval": "1s",
                    },
                    "rule_files": [str(ALERT_RULES)],
                    "scrape_configs": [
                        {
                            "job_name": "kvbm",
                            "metrics_path": "/metrics",
                            "static_configs": [{"targets": [target]}],
                        }
                    ],
                }
            )
        )
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for_http(
            f"{self.url}/-/ready",
            self.process,
            timeout,
            "prometheus",
            on_exit=self.log_tail,
            on_timeout=self.log_tail,
        )

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector; raises on a PromQL error."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            raise AssertionError(
                f"Prometheus rejected {expr!r}: {err.read().decode(errors='replace')}"
            ) from None
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, ok, timeout: float, what: str) -> float | None:
        deadline = time.monotonic() + timeout
        while True:
            value = self.value(expr)
            if value is not None and ok(value):
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {expr} = {value} after {timeout:.0f} s")
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        self._log.close()
