"""kvbm-bench's command line: --version, defaults in every subcommand's help,
and the [bench] extra checked before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from vllm_kvbm.bench.__main__ import main

SUBCOMMANDS = ["multi-round", "doc-qa", "compare"]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvbm-bench {version('vllm-kvbm')}"


def test_installed_script_answers_version():
    script = os.path.join(os.path.dirname(sys.executable), "kvbm-bench")
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvbm-bench {version('vllm-kvbm')}"


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_help_shows_every_default(cmd, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([cmd, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--qps QPS requests per second" in text and "(default: 0.5)" in text
    assert "--seed SEED (default: 0)" in text  # a default of 0 is shown too
    assert "--request-timeout REQUEST_TIMEOUT (default: 300)" in text
    if cmd == "compare":
        assert "--block-size BLOCK_SIZE (default: 128)" in text
        assert "(default: 1GiB)" in text
        # help that already states its default is not repeated
        assert "model path (default: the local model) --workload" in text
    else:
        assert f"(default: {cmd}.csv)" in text


@pytest.mark.parametrize("cmd,module", [("compare", "matplotlib"), ("multi-round", "aiohttp"),
                                        ("doc-qa", "tqdm")])
def test_missing_bench_extra_stops_before_any_run(cmd, module, tmp_path, monkeypatch, capsys):
    # None in sys.modules makes the module unimportable, as an install without it
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)
    assert main([cmd, "--out-dir", str(tmp_path / "out")] if cmd == "compare" else
                [cmd, "--base-url", "http://127.0.0.1:9", "--model", "m"]) == 2
    err = capsys.readouterr().err
    # from the release's tag: the package is not on PyPI
    assert module in err and ('pip install "vllm-kvbm[bench] @ git+https://github.com/'
                              f'vllm-kvbm/vllm-kvbm@v{version("vllm-kvbm")}"') in err
    assert list(tmp_path.iterdir()) == []  # no results directory, no model built


def test_unknown_command(capsys):
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err
