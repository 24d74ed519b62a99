"""The command line as a newcomer meets it: --help lists every command, --version, errors in
the CLI's own words, a quiet access log while /health answers 503."""

import logging

import pytest

from moeserve import __version__
from moeserve.cli import build_parser, cli_words, main

COMMANDS = ["generate", "chat", "bench", "sweep", "plan", "serve", "wait-ready", "systemd-unit"]


def test_help_lists_every_command_without_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)
    assert "``" not in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


@pytest.mark.parametrize(
    "message, said",
    [
        ("no weights in /x (use load_format='dummy' for random weights)", "no weights in /x (use --load-format dummy for random weights)"),
        ("a prompt dict needs 'prompt' or 'prompt_token_ids'", "a prompt dict needs 'prompt' or --prompt-token-ids"),
        ("prompt of 5 tokens leaves no token within max_model_len=4", "prompt of 5 tokens leaves no token within --max-model-len 4"),
        ("tensor_parallel_size=3 does not divide", "--tensor-parallel-size 3 does not divide"),
        ("heads not divisible by tp=3", "heads not divisible by tp=3"),  # a layout's name, not a flag
    ],
)
def test_errors_speak_cli(message, said):
    assert cli_words(message, build_parser()) == said


def test_a_cli_error_names_the_flag(capsys, tmp_path):
    import shutil

    from moeserve.demo import ensure_demo_model

    shutil.copy(ensure_demo_model() / "config.json", tmp_path / "config.json")  # a config, no weights
    assert main(["generate", "--model", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--load-format dummy" in err and "load_format=" not in err


def test_health_polls_are_logged_once_while_starting():
    from moeserve.server.commands import QuietHealthPolls

    f = QuietHealthPolls()

    def logged(path, status):
        args = ("127.0.0.1:5000", "GET", path, "1.1", status)
        return f.filter(logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None))

    assert [logged("/health", 503) for _ in range(5)] == [True, False, False, False, False]
    assert logged("/v1/models", 503) and logged("/health", 200) and logged("/health", 200)


def test_sweep_knows_a_cpu_server():
    from moeserve.bench.sweep import servers_run_on_cpu

    assert servers_run_on_cpu(["--device", "cpu"]) and servers_run_on_cpu(["--device=cpu"])
    assert not servers_run_on_cpu(["--device", "cuda"])
