"""What a newcomer meets first: options, exit statuses, labelled output, banner and page.

* Every entry point refuses an unknown option with the usage line and exit 2 (a misspelt
  ``--max-sesions`` never passes silently); mlx-vlm's own options are accepted with a note,
  and the tables of them follow the installed mlx-vlm's parsers.
* One exit-status table (``mlx_voicechat_plugin.exit_codes``): the same mistake gives the
  same status in every command, and input errors are reported before heavy imports.
* The assistant text is printed on a labelled line, control characters escaped on a
  terminal; the serve banner names the WebSocket and the page; the page says when the
  checkpoint is a random-weight demo.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_voicechat_plugin.cli import compat
from mlx_voicechat_plugin.cli.output import escape_controls, for_stream, labelled
from mlx_voicechat_plugin.exit_codes import EXIT_USAGE

SPEECH_WAV = Path(__file__).parent / "data" / "question.wav"
HEAVY = ("mlx_vlm", "mlx_audio", "transformers", "uvicorn", "fastapi")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# --------------------------------------------------------------------------- mlx-vlm's options


def _upstream_options(function) -> dict[str, object]:
    """The option strings (and nargs) of the parser ``function`` builds, captured at parse."""

    class Captured(Exception):
        pass

    def capture(self, *args, **kwargs):
        raise Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        function()
    except Captured as captured:
        parser = captured.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    options = {}
    for action in parser._actions:
        for flag in action.option_strings:
            options[flag] = action.nargs
    return options


def _expected(table_nargs) -> object:
    return {0: 0, None: 1}.get(table_nargs, table_nargs)


@pytest.mark.parametrize("which", ["generate", "server"])
def test_compat_tables_follow_the_installed_mlx_vlm(which):
    if which == "generate":
        module = importlib.import_module("mlx_vlm.generate.dispatch")
        upstream = _upstream_options(module.parse_arguments)
        from mlx_voicechat_plugin.cli.generate import build_parser

        table, parser = compat.GENERATE_FLAGS, build_parser()
    else:
        module = importlib.import_module("mlx_vlm.server.cli")
        main = getattr(module.main, "__wrapped__", module.main)  # past the shim's hook
        upstream = _upstream_options(main)
        from mlx_voicechat_plugin.server.cli import build_parser

        table, parser = compat.SERVER_FLAGS, build_parser("serve")
    own = {flag for flag, action in parser._option_string_actions.items()
           if not isinstance(action, compat._Ignored)}
    for flag, nargs in upstream.items():
        if flag in own:
            continue
        assert flag in table, f"mlx-vlm's {flag} is missing from the table"
        assert table[flag] == _expected(nargs), (flag, nargs, table[flag])
    for flag in table:
        assert flag in upstream or flag in own, f"{flag} is not an mlx-vlm option"


def test_mlx_vlm_options_are_accepted_with_a_note():
    from mlx_voicechat_plugin.server.cli import build_parser

    args = build_parser("serve").parse_args(["--max-num-seqs", "4", "--reload", "--kv-bits", "8"])
    assert compat.ignored_note(args) == (
        "note: ignoring mlx-vlm options that do not apply to this model: "
        "--max-num-seqs --reload --kv-bits"
    )
    assert compat.ignored_note(build_parser("serve").parse_args([])) is None


def _in_process(main, argv, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv, **kwargs)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "command,argv",
    [
        ("generate", ["--audio", str(SPEECH_WAV), "--output-audio", "x.wav", "--bogus-flag", "7"]),
        ("serve", ["--port", "8080", "--max-sesions", "4"]),
        ("serve", ["--bogus-flag", "7"]),
        ("demo", ["build", "out", "--presett", "tiny"]),
    ],
    ids=["generate", "serve-misspelt", "serve-bogus", "demo"],
)
def test_unknown_options_are_refused_with_the_usage_line(tmp_path, monkeypatch, command, argv):
    from mlx_voicechat_plugin.cli.main import main

    monkeypatch.chdir(tmp_path)
    code, out, err = _in_process(main, [command, *argv])
    assert code == EXIT_USAGE
    assert err.startswith("usage: mlx-voicechat " + command), err
    assert "unrecognized arguments" in err and argv[-2] in err
    assert out == "" and not (tmp_path / "x.wav").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", ["mlx_vlm.server", "mlx_vlm.generate"])
def test_mlx_vlm_entry_points_refuse_unknown_options(tiny, module):
    extra = ["--audio", str(SPEECH_WAV), "--output-audio", "x.wav"] if module.endswith("generate") else []
    completed = subprocess.run(
        [sys.executable, "-m", module, "--model", str(tiny), *extra, "--bogus-flag", "7"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == EXIT_USAGE, completed.stderr
    assert completed.stderr.startswith(f"usage: python -m {module}"), completed.stderr
    assert "--bogus-flag" in completed.stderr and "Traceback" not in completed.stderr
    assert "serving" not in completed.stderr


def test_server_only_options_are_ours_alone():
    """Each option that routes ``python -m mlx_vlm.server`` to our server when ``--model``
    does not resolve is one our parser takes and mlx-vlm's does not (its parser read past
    the shim's hook): routing never takes a command mlx-vlm could run."""
    from mlx_voicechat_plugin.registration.command_hooks import SERVER_ONLY_OPTIONS
    from mlx_voicechat_plugin.server.cli import build_parser

    module = importlib.import_module("mlx_vlm.server.cli")
    upstream = _upstream_options(getattr(module.main, "__wrapped__", module.main))
    ours = set(build_parser("serve")._option_string_actions)
    assert "--port" in upstream and "--max-sessions" in ours
    for option in SERVER_ONLY_OPTIONS:
        assert option in ours and option not in upstream, option


def _run_server_hook(monkeypatch, argv: list[str]) -> tuple[object, str]:
    from mlx_voicechat_plugin.registration.shim import install

    install(force=True)
    module = importlib.import_module("mlx_vlm.server.cli")
    monkeypatch.setattr(sys, "argv", ["mlx_vlm.server", *argv])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as caught:
            module.main()
    return caught.value.code, err.getvalue()


@pytest.mark.parametrize("checkpoint", ["missing", "empty", "corrupt"])
def test_mlx_vlm_server_with_our_options_and_an_unresolved_model_gets_our_error(checkpoint, monkeypatch, tmp_path):
    """``python -m mlx_vlm.server --model <mistyped, empty or corrupt> --max-sessions 4``:
    our one-line checkpoint error and exit 2, not mlx-vlm's usage text or its start-up
    traceback; nothing listens."""
    model = tmp_path / "ckpt"
    if checkpoint != "missing":
        model.mkdir()
    if checkpoint == "corrupt":
        (model / "config.json").write_text("{not json")
    code, err = _run_server_hook(monkeypatch, ["--model", str(model), "--max-sessions", "4", "--port", "8931"])
    lines = err.strip().splitlines()
    assert code == EXIT_USAGE, err
    assert len(lines) == 1 and lines[0].startswith(f"error: {model}"), err
    assert "Traceback" not in err and "unrecognized arguments" not in err


def test_mlx_vlm_server_with_our_options_and_another_model_family_stays_with_mlx_vlm(monkeypatch, tmp_path):
    """A checkpoint of another family goes to mlx-vlm's own server even with our options
    (its parser refuses them): our server would describe it as a speech model."""
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen2_vl"}')
    code, err = _run_server_hook(monkeypatch, ["--model", str(other), "--max-sessions", "4"])
    assert code == 2
    assert "unrecognized arguments: --max-sessions 4" in err and f"error: {other}" not in err


# --------------------------------------------------------------------------- exit statuses


def _subprocess_main(argv: list[str], cwd: Path) -> tuple[int, str, list[str]]:
    """Run ``mlx-voicechat ARGV`` in a fresh interpreter; returns the status, stderr and the
    heavy modules that were imported."""
    script = (
        "import json, sys\n"
        "from mlx_voicechat_plugin.cli.main import main\n"
        f"code = main({argv!r})\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        "sys.exit(code)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               cwd=cwd, timeout=120)
    return completed.returncode, completed.stderr, json.loads(completed.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "argv,words",
    [
        (["generate", "--audio", "missing.wav", "--output-audio", "a.wav"], "missing.wav"),
        (["generate", "--audio", str(SPEECH_WAV), "--output-audio", "a.mp3"], ".wav"),
        (["generate", "--model", "/nonexistent", "--audio", str(SPEECH_WAV), "--output-audio", "a.wav"],
         "/nonexistent"),
        (["serve", "--model", "/nonexistent"], "/nonexistent"),
        (["serve", "--api-key", ""], "--api-key is empty"),
        (["serve", "--api-key= "], "--api-key is empty"),
        (["serve", "--api-key", "k3y "], "whitespace"),
        (["serve", "--api-key", "ключ"], "printable ASCII"),
        (["serve", "--api-key", "sek\nrit"], "printable ASCII"),
        (["serve", "--max-sessions", "65"], "exceeds --max-connections 64"),
        (["serve", "--max-sessions", "8", "--max-connections", "4"], "exceeds --max-connections 4"),
        (["serve", "--alias", " "], "--alias"),
        (["serve", "--alias", "a\x1bb"], "--alias"),
        (["serve", "--cors-origins", "not a url"], "--allowed-origins entry 'not'"),
        (["serve", "--allowed-origins", "http://a.example/path"], "not a browser Origin"),
        (["demo", "build", "."], "already exists"),
        (["generate", "--model", "", "--audio", str(SPEECH_WAV), "--output-audio", "a.wav"], "--model is empty"),
    ],
    ids=["missing-input", "mp3-output", "generate-bad-model", "serve-bad-model", "serve-empty-key",
         "serve-blank-key", "serve-padded-key", "serve-non-ascii-key", "serve-control-key",
         "serve-sessions-over-connections", "serve-sessions-over-custom-connections", "serve-blank-alias",
         "serve-control-alias", "serve-origin-not-url", "serve-origin-with-path", "demo-existing",
         "generate-empty-model"],
)
def test_the_same_mistake_exits_2_before_heavy_imports(tmp_path, argv, words):
    code, err, heavy = _subprocess_main(argv, tmp_path)
    assert code == EXIT_USAGE, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert heavy == [], f"imported {heavy} before reporting the error"
    assert list(tmp_path.iterdir()) == []


def test_serve_help_lists_every_status_serve_exits_with():
    """``serve --help`` names 143 (SIGTERM) besides the shared statuses (README table)."""
    from mlx_voicechat_plugin.server.cli import build_parser

    text = " ".join(build_parser("mlx-voicechat serve").format_help().split())
    for status in ("0 done", "1 failure", "2 usage or input error", "130 interrupted", "143 stopped by SIGTERM"):
        assert status in text, text


def test_file_client_uses_the_same_table(tmp_path):
    from mlx_voicechat_plugin.clients import file as file_client

    code, _, err = _in_process(file_client.main, ["ws://127.0.0.1:9/v1/realtime", "missing.wav", str(tmp_path / "a.wav")])
    assert code == EXIT_USAGE, err
    code, _, err = _in_process(file_client.main, ["ws://127.0.0.1:9/v1/realtime", str(SPEECH_WAV), str(tmp_path / "a.mp3")])
    assert code == EXIT_USAGE, err


# --------------------------------------------------------------------------- output


def test_control_characters_are_escaped_on_a_terminal_only():
    text = "ok\x01\x04\x0e\x14\x7f\x9b end\tand\nmore"
    assert escape_controls(text) == "ok\\x01\\x04\\x0e\\x14\\x7f\\x9b end\tand\nmore"
    assert for_stream(text, _Terminal()) == escape_controls(text)
    assert for_stream(text, io.StringIO()) == text  # a pipe or file gets the exact text
    assert labelled("assistant", "hi\x0e", _Terminal()) == "[assistant] hi\\x0e"


def test_generate_prints_labelled_lines_and_the_wav_path(tiny, tmp_path, monkeypatch):
    from mlx_voicechat_plugin.cli.main import main

    terminal = _Terminal()
    output = tmp_path / "answer.wav"
    err = io.StringIO()
    with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(err):
        code = main(["generate", "--model", str(tiny), "--audio", str(SPEECH_WAV),
                     "--extra-decoding-seconds", "0.5", "--output-audio", str(output)])
    assert code == 0, err.getvalue()
    lines = terminal.getvalue().splitlines()
    assert lines[0].startswith("[user] ") and lines[1].startswith("[assistant] ")
    for line in lines:
        assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in line), repr(line)
    assert f"[audio] wrote {output} (" in err.getvalue() and "22050 Hz mono PCM16" in err.getvalue()
    assert "replaced" not in err.getvalue()
    again = io.StringIO()  # the same output again: replaced, and the line says so
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(again):
        assert main(["generate", "--model", str(tiny), "--audio", str(SPEECH_WAV),
                     "--extra-decoding-seconds", "0.5", "--output-audio", str(output)]) == 0
    assert "22050 Hz mono PCM16; replaced the existing file)" in again.getvalue(), again.getvalue()


@pytest.mark.parametrize(
    "argv",
    [
        ["--audio", str(SPEECH_WAV), "--audio", str(SPEECH_WAV), "--output-audio", "a.wav"],
        ["--audio", str(SPEECH_WAV), "--output-audio", "a.wav", "--output", "b.wav"],
        ["--audio", str(SPEECH_WAV), "--output-audio", "a.wav", "-p", "x", "--prompt", "y"],
        ["--model", "a", "--model", "b", "--audio", str(SPEECH_WAV), "--output-audio", "a.wav"],
    ],
    ids=["audio", "output", "prompt", "model"],
)
def test_generate_refuses_an_option_given_twice(argv, capsys):
    """argparse would keep the last value silently (answering another file than meant)."""
    from mlx_voicechat_plugin.cli.main import main

    assert main(["generate", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "was given more than once" in err and err.startswith("usage: "), err


def test_a_system_prompt_over_the_token_limit_is_an_input_error(tiny, tmp_path, capsys):
    from mlx_voicechat_plugin.cli.main import main

    code = main(["generate", "--model", str(tiny), "--audio", str(SPEECH_WAV), "--output-audio",
                 str(tmp_path / "a.wav"), "-p", "word " * 600])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == EXIT_USAGE and len(lines) == 1 and "at most 512" in lines[0], err
    assert not (tmp_path / "a.wav").exists()


# --------------------------------------------------------------------------- banner and page


def test_serve_banner_names_the_socket_and_the_page(tiny, tmp_path, monkeypatch):
    import shutil

    from mlx_voicechat_plugin.server import cli as server_cli
    from mlx_voicechat_plugin.server import serving

    demo = tmp_path / "demo"
    shutil.copytree(tiny, demo)
    monkeypatch.setattr(serving.VoiceChatServer, "run", lambda self, sockets=None: None)
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, _, err = _in_process(server_cli.main, ["--model", str(demo), "--port", str(port),
                                                 "--host", "0.0.0.0", "--api-prefix", "/v"],
                               hard_exit=False)
    assert code == 0, err
    assert f"ws://localhost:{port}/v/v1/realtime" in err
    assert f"http://localhost:{port}/v/voicechat" in err
    assert "random-weight demo checkpoint" in err


@pytest.mark.parametrize("demo", [True, False])
def test_page_says_when_the_checkpoint_is_a_demo(tiny, engine, demo):
    from .test_server_support import ServerHandle, http, server_settings

    with ServerHandle(server_settings(tiny, demo_checkpoint=demo), engine) as handle:
        status, page = http("GET", handle.http_url("/voicechat"))
    assert status == 200
    assert ('id="demo-note"' in page) is demo
    assert ("random-weight" in page) is demo


def test_demo_checkpoints_are_recognised(tiny, tmp_path):
    from mlx_voicechat_plugin.checkpoint import is_demo_checkpoint

    assert is_demo_checkpoint(tiny)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert not is_demo_checkpoint(other) and not is_demo_checkpoint(tmp_path / "missing")


# --------------------------------------------------------------------------- first-run notes


def test_progress_notes_reach_stderr_and_survive_loading(tiny, monkeypatch, capsys, caplog):
    """The native kernel build says what it is doing (issue: a silent 12 s on the first run):
    the progress logger prints on stderr once the commands enable it, and loading a
    checkpoint no longer silences every logger (only mlx-vlm's root-logger advice)."""
    import logging

    from mlx_voicechat_plugin import loading, progress

    seen = []

    def fake_load_model(path, lazy=False):
        progress.logger().info("[native] note during load")
        logging.getLogger("mlx_voicechat_plugin.accel").warning("kept warning")
        logging.error("mlx-vlm advice for other model families")
        seen.append(path)
        raise RuntimeError("stop here")

    import mlx_vlm.utils

    monkeypatch.setattr(mlx_vlm.utils, "load_model", fake_load_model)
    progress.show_on_stderr()
    progress.show_on_stderr()  # idempotent: one handler
    try:
        with pytest.raises(loading.CheckpointError):
            loading.load(tiny)
        err = capsys.readouterr().err
        assert err.count("[native] note during load") == 1
        messages = [record.getMessage() for record in caplog.records]
        assert "kept warning" in messages  # our loggers still reach the root's handlers
        assert "mlx-vlm advice for other model families" not in messages
        assert logging.getLogger().filters == []  # the root filter is removed after loading
    finally:
        log = progress.logger()
        for handler in list(log.handlers):
            log.removeHandler(handler)
        log.propagate = True
        log.setLevel(logging.NOTSET)


def test_serve_refuses_an_empty_api_key_from_the_environment(tmp_path, monkeypatch):
    """``MLX_VOICECHAT_API_KEY=$UNSET`` would otherwise serve without authentication."""
    monkeypatch.setenv("MLX_VOICECHAT_API_KEY", "")
    code, err, heavy = _subprocess_main(["serve"], tmp_path)
    assert code == EXIT_USAGE and "MLX_VOICECHAT_API_KEY is empty" in err and heavy == [], err


def test_serve_checks_its_options_before_building_the_demo_checkpoint(tmp_path, monkeypatch):
    """A bad option is reported before the (default) model is looked at or built."""
    monkeypatch.setenv("MLX_VOICECHAT_CACHE", str(tmp_path / "cache"))
    code, err, heavy = _subprocess_main(["serve", "--send-timeout", "0"], tmp_path)
    assert code == EXIT_USAGE, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: --send-timeout "), err
    assert not (tmp_path / "cache").exists() and heavy == []
