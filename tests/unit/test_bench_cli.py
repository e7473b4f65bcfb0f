"""kvbm-bench's command line: --version, defaults, examples and exit codes in
every subcommand's help, bad arguments refused naming the flag and the fix,
the [bench] extra checked before anything runs."""

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
    assert main([cmd, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--qps QPS requests per second" in text and "(default: 0.5)" in text
    assert "--seed SEED (default: 0)" in text  # a default of 0 is shown too
    assert "--request-timeout REQUEST_TIMEOUT seconds one request may take" in text
    assert "(default: 300)" in text
    # examples, and the exit codes with what each means
    assert f"examples: kvbm-bench {cmd} " in text
    for code in ("0 the run finished", "1 a run failed", "2 bad arguments", "130 interrupted"):
        assert code in text
    if cmd == "compare":
        assert (
            "--block-size BLOCK_SIZE tokens per block (default: 128 with --serve-defaults "
            "cpu, vLLM's own with none)" in text
        )
        assert "(default: 1GiB)" in text
        # help that already states its default is not repeated
        assert (
            "(default: the local model; with --url: the one the first server lists) "
            "--tokenizer" in text
        )
        # the serve defaults, what they are for, and how to replace each
        assert (
            "--serve-defaults cpu, the default on vLLM's CPU build: every server gets "
            "--block-size 128 --num-gpu-blocks-override 48 --max-model-len 6016 "
            "--max-num-batched-tokens 6016 --gpu-memory-utilization 0.3 --enforce-eager "
            "--seed 0: an engine KV cache too small"
        ) in text
        assert "replaces the default of the same flag" in text
        assert "3 compare: every configuration ran, but not on the same CPU cores" in text
    else:
        assert f"(default: {cmd}.csv)" in text


def test_top_level_help_and_no_command(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(cmd in text for cmd in SUBCOMMANDS) and "exit codes:" in text
    assert main([]) == 2  # nothing to run is an error, not a success
    assert "name a command (multi-round, doc-qa or compare)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,flag,fix",
    [
        (
            ["multi-round", "--base-url", "http://127.0.0.1:9", "--num-users", "0"],
            "--num-users",
            "must be 1 or more (got 0); e.g. --num-users 6",
        ),
        (["compare", "--num-rounds", "two"], "--num-rounds", "'two' is not a whole number"),
        (["compare", "--qps", "0"], "--qps", "must be more than 0 (got 0); e.g. --qps 0.5"),
        (
            ["doc-qa", "--base-url", "http://127.0.0.1:9", "--hit-ratio", "1.5"],
            "--hit-ratio",
            "must be between 0 and 1",
        ),
        (
            ["compare", "--host-cache-size", "lots"],
            "--host-cache-size",
            "cannot read 'lots' as a size; write it like",
        ),
        (
            ["multi-round", "--base-url", "127.0.0.1:8000"],
            "--base-url",
            "is not an http(s) URL; give the server's root, e.g. http://127.0.0.1:8000",
        ),
        (["compare", "--url", "http://h1:8000"], "--url", "give NAME=URL"),
        (
            ["compare", "--url", "a=http://h1:8000", "--url", "a=http://h2:8000"],
            "--url",
            "the name 'a' is given twice",
        ),
        (
            ["compare", "--url", "a=http://h1:8000", "--engine-kv-blocks", "16"],
            "--engine-kv-blocks",
            "--url starts none",
        ),
        (
            ["compare", "--url", "a=http://h1:8000", "--", "--enforce-eager"],
            "after --",
            "--url starts none",
        ),
        (
            ["compare", "--configs", "vllm", "--url", "a=http://h1:8000"],
            "--url",
            "not allowed with argument --configs",
        ),
        (
            ["multi-round", "--base-url", "http://127.0.0.1:9", "--", "--enforce-eager"],
            "after --",
            "only compare --configs starts servers",
        ),
        (
            ["compare", "--serve-defaults", "none", "--engine-kv-blocks", "16"],
            "--engine-kv-blocks",
            "give --block-size too",
        ),
        (
            ["compare", "--workload", "doc-qa", "--lmbenchmark-dir", "/nowhere"],
            "--lmbenchmark-dir",
            "use --workload multi-round",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag_and_the_fix(
    args, flag, fix, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert flag in err and fix in err, err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing was written


def test_a_server_that_does_not_answer_exits_1_naming_the_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["multi-round", "--base-url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "--base-url: cannot reach the server at http://127.0.0.1:9" in err
    assert main(["compare", "--url", "a=http://127.0.0.1:9", "--out-dir", "out"]) == 1
    assert "--url a: cannot reach the server at http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.parametrize(
    "cmd,module",
    [
        ("compare", "matplotlib"),
        ("multi-round", "openai"),
        ("doc-qa", "tqdm"),
        ("compare", "psutil"),
    ],
)
def test_missing_bench_extra_stops_before_any_run(cmd, module, tmp_path, monkeypatch, capsys):
    # None in sys.modules makes the module unimportable, as an install without it
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [cmd, "--out-dir", str(tmp_path / "out")]
            if cmd == "compare"
            else [cmd, "--base-url", "http://127.0.0.1:9", "--model", "m"]
        )
        == 2
    )
    err = capsys.readouterr().err
    # from the release's tag: the package is not on PyPI
    assert (
        module in err
        and (
            'pip install "vllm-kvbm[bench] @ git+https://github.com/'
            f'vllm-kvbm/vllm-kvbm@v{version("vllm-kvbm")}"'
        )
        in err
    )
    assert list(tmp_path.iterdir()) == []  # no results directory, no model built


def test_unknown_command(capsys):
    assert main(["bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
