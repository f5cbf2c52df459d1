"""The offline ``generate`` command (spec "CLI" and "Limits").

``mlx-voicechat generate`` and ``python -m mlx_vlm.generate --model <voicechat>`` run one
offline turn: stdout is ``[user] <transcript>``, ``[assistant] <text>``, then
``[function] <text>`` when non-empty (stderr says where the WAV was written); the answer is a 22050 Hz mono PCM16 WAV of
``frames * 1764`` samples, byte-identical for the same seed. Bad input fails with one line
on stderr before the model is loaded and never creates or touches the output file.

Most runs are in-process ``main(argv)`` calls on the tiny demo checkpoint with
``--extra-decoding-seconds 0.5``; the real console scripts run as subprocesses only where
the entry point itself is under test.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile

from mlx_voicechat_plugin.cli.main import main as cli_main

from .conftest import SPEECH_WAV
from .test_audio_io import FORMATS, make_input

PROMPT = "Be concise."
SHORT = ["--extra-decoding-seconds", "0.5"]
SAMPLES_PER_FRAME = 1764  # 80 ms at 22.05 kHz


# --------------------------------------------------------------------------- helpers


class _TTY(io.StringIO):
    """A captured stream that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


@dataclass
class Run:
    code: int
    out: str
    err: str
    wav: Path | None = None

    @property
    def wav_bytes(self) -> bytes:
        return self.wav.read_bytes()

    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def run(*argv, output: Path | None = None, tty: bool = False) -> Run:
    """``mlx-voicechat generate ARGV [--output-audio OUTPUT]`` in-process, output captured."""
    args = ["generate", *map(str, argv)]
    if output is not None:
        args += ["--output-audio", str(output)]
    out, err = io.StringIO(), (_TTY() if tty else io.StringIO())
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(args)
    return Run(code, out.getvalue(), err.getvalue(), output)


def _subprocess_env() -> dict:
    env = dict(os.environ)
    env.pop("MLX_VOICECHAT_DISABLE_SHIM", None)
    env["PYTHONIOENCODING"] = "utf-8"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def run_process(command: list, output: Path | None = None) -> Run:
    completed = subprocess.run(
        [str(part) for part in command], capture_output=True, env=_subprocess_env(), timeout=120
    )
    return Run(
        completed.returncode,
        completed.stdout.decode("utf-8"),
        completed.stderr.decode("utf-8"),
        output,
    )


def console_script() -> str:
    candidate = Path(sys.executable).with_name("mlx-voicechat")
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("mlx-voicechat")
    assert found, "the mlx-voicechat console script is not installed"
    return found


def expected_stdout(result) -> str:
    lines = [f"[user] {result.user_transcript or ''}", f"[assistant] {result.text}"]
    if result.function_text:
        lines.append(f"[function] {result.function_text}")
    return "\n".join(lines) + "\n"


def assert_answer_wav(path: Path) -> int:
    """A 22050 Hz mono PCM16 WAV whose length is a whole number of frames; returns frames."""
    info = soundfile.info(str(path))
    assert (info.format, info.samplerate, info.channels, info.subtype) == (
        "WAV", 22_050, 1, "PCM_16",
    )
    assert info.frames > 0 and info.frames % SAMPLES_PER_FRAME == 0, info.frames
    return info.frames // SAMPLES_PER_FRAME


def has_progress_bar(err: str) -> bool:
    return "voice turn" in err and "frame" in err and "\r" in err


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(checkpoint) -> Path:
    return checkpoint("tiny")


@pytest.fixture(scope="module")
def reference(tiny):
    """The library's own offline turn for the baseline arguments (seed 0, 0.5 s extra)."""
    from mlx_voicechat_plugin.loading import load

    model, tokenizer = load(tiny)
    return model.create_session(tokenizer).generate(
        str(SPEECH_WAV), system_prompt=PROMPT, extra_decoding_seconds=0.5, seed=0
    )


@pytest.fixture(scope="module")
def baseline(tiny, tmp_path_factory) -> Run:
    """``generate --model TINY --audio question.wav -p "Be concise." --extra 0.5``."""
    output = tmp_path_factory.mktemp("baseline") / "answer.wav"
    result = run("--model", tiny, "--audio", SPEECH_WAV, "-p", PROMPT, *SHORT, output=output)
    assert result.code == 0, result.err
    return result


@pytest.fixture(scope="module")
def long_inputs(tmp_path_factory) -> dict:
    """Silent 16 kHz PCM16 FLACs of exactly 20 minutes and of 20 minutes + 1 s."""
    directory = tmp_path_factory.mktemp("long")
    paths = {}
    for name, seconds in (("20min", 20 * 60), ("20min1s", 20 * 60 + 1)):
        paths[name] = directory / f"silence_{name}.flac"
        soundfile.write(str(paths[name]), np.zeros(16_000 * seconds, np.int16), 16_000,
                        subtype="PCM_16")
    return paths


# --------------------------------------------------------------------------- the turn itself


def test_cli_matches_library_turn(baseline, reference):
    assert baseline.out == expected_stdout(reference)
    assert baseline.out.startswith("[user] ")
    if reference.function_text:
        assert f"\n[function] {reference.function_text}\n" in baseline.out
    assert "Traceback" not in baseline.err
    frames = assert_answer_wav(baseline.wav)
    assert frames == reference.frames
    pcm, rate = soundfile.read(str(baseline.wav), dtype="int16")
    assert rate == 22_050
    expected = np.clip(np.round(reference.audio.astype(np.float64) * 32768), -32768, 32767)
    assert pcm.shape == (reference.frames * SAMPLES_PER_FRAME,)
    np.testing.assert_array_equal(pcm, expected.astype(np.int16))


def test_console_script_subprocess(tiny, baseline, tmp_path):
    output = tmp_path / "r.wav"
    result = run_process(
        [console_script(), "generate", "--model", tiny, "--audio", SPEECH_WAV,
         "--output-audio", output, "-p", PROMPT, *SHORT],
        output,
    )
    assert result.code == 0, result.err
    assert "Traceback" not in result.err
    assert result.out == baseline.out
    assert_answer_wav(output)
    assert result.wav_bytes == baseline.wav_bytes  # same seed, another process


@pytest.mark.parametrize("mode", [[], ["--stream"]], ids=["offline", "stream"])
def test_one_stream_for_both_keeps_the_text_before_the_audio_line(tiny, tmp_path, mode):
    """``> log 2>&1`` or a pipe: the text lines (stdout) come before the ``[audio]`` line
    (stderr), each on its own line."""
    output = tmp_path / "r.wav"
    env = _subprocess_env()
    env.pop("PYTHONUNBUFFERED", None)  # a pipe's stdout is block-buffered, as for a user
    completed = subprocess.run(
        [console_script(), "generate", "--model", tiny, "--audio", SPEECH_WAV, "--output-audio", str(output),
         *SHORT, *mode],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout
    lines = [line for line in completed.stdout.decode("utf-8").splitlines() if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in lines[-1:]] == ["[audio]"], lines
    labels = [line.split("]")[0] + "]" for line in lines[:-1]]
    assert "[user]" in labels and "[assistant]" in labels and "[audio]" not in labels, lines
    assert all(line.count("[audio] wrote") <= 1 and not ("[assistant]" in line and "[audio]" in line) for line in lines)


@pytest.mark.parametrize("mode", [[], ["--stream"]], ids=["offline", "stream"])
@pytest.mark.parametrize("reader", ["closed", "gone"])
def test_text_nobody_reads_is_dropped_and_the_answer_still_written(tiny, tmp_path, mode, reader):
    """Standard output closed (``>&-``) or its reader gone after one byte (``| head -c1``, a
    broken pipe): exit 0, the WAV written, no traceback."""
    output = tmp_path / "a.wav"
    command = [console_script(), "generate", "--model", tiny, "--audio", SPEECH_WAV, "--output-audio", str(output),
               *SHORT, *mode]
    env = _subprocess_env()
    env.pop("PYTHONUNBUFFERED", None)
    if reader == "closed":
        completed = subprocess.run(
            ["sh", "-c", '"$@" >&-', "sh", *map(str, command)], stderr=subprocess.PIPE, env=env, timeout=120,
        )
        code, err = completed.returncode, completed.stderr.decode()
    else:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert len(process.stdout.read(1)) == 1
        process.stdout.close()  # the reader goes away: the next write gets EPIPE
        _, err = process.communicate(timeout=120)
        code, err = process.returncode, err.decode()
    assert code == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err and "Broken pipe" not in err, err
    assert f"[audio] wrote {output}" in err
    assert_answer_wav(output)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("mode", [[], ["--stream"]], ids=["offline", "stream"])
def test_text_that_cannot_be_written_is_reported_and_the_answer_still_written(tiny, tmp_path, mode):
    """Standard output on a full disk (``>/dev/full``: every write fails with ENOSPC): the
    WAV is written, one error line names the failed write, exit 1, no traceback."""
    output = tmp_path / "a.wav"
    command = [console_script(), "generate", "--model", tiny, "--audio", SPEECH_WAV, "--output-audio", str(output),
               *SHORT, *mode]
    with open("/dev/full", "w") as full:
        completed = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, env=_subprocess_env(), timeout=120)
    err = completed.stderr.decode()
    assert completed.returncode == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert f"[audio] wrote {output}" in err
    assert "could not write the text to standard output" in err and "No space left" in err, err
    assert_answer_wav(output)


@pytest.mark.parametrize("stderr", ["full", "gone", "closed"])
def test_a_standard_error_that_cannot_be_written_never_fails_the_command(tiny, tmp_path, stderr):
    """``2>/dev/full``, ``2>&1 | head -1`` (the reader gone after the first line) and
    ``2>&-``: the WAV and the text are written and the command exits 0 (the failed
    ``[audio] wrote`` line raised, and so did the error line printed for it: exit 1)."""
    if stderr == "full" and not Path("/dev/full").exists():
        pytest.skip("needs /dev/full (Linux)")
    output, text = tmp_path / "a.wav", tmp_path / "text.txt"
    command = [console_script(), "generate", "--model", tiny, "--audio", SPEECH_WAV, "--output-audio", str(output), *SHORT]
    env = _subprocess_env()
    if stderr == "gone":
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        first = process.stdout.readline()
        process.stdout.close()  # the reader goes away: later writes to either stream get EPIPE
        code = process.wait(timeout=120)
        assert first.startswith(b"["), first
    else:
        redirect = "2>/dev/full" if stderr == "full" else "2>&-"
        with open(text, "w") as out:
            code = subprocess.run(
                ["sh", "-c", f'"$@" {redirect}', "sh", *map(str, command)], stdout=out, env=env, timeout=120,
            ).returncode
        assert "[assistant]" in text.read_text()
    assert code == 0
    assert_answer_wav(output)


_FAILING_TURN = """
import sys
import mlx_voicechat_plugin.runtime.offline as offline
real, calls = offline.speech_step, []
def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        raise RuntimeError("injected EAR-TTS failure")
    return real(*args, **kwargs)
offline.speech_step = failing
from mlx_voicechat_plugin.cli.generate import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failure_mid_turn_exits_1_while_the_workers_still_run(tiny, tmp_path):
    """EAR-TTS failing on the third frame of a long turn, while the language model and RNNT
    worker threads still evaluate: one error line and exit 1 (the process used to abort
    with 134, "terminate called without an active exception")."""
    output = tmp_path / "a.wav"
    completed = subprocess.run(
        [sys.executable, "-c", _FAILING_TURN, "--model", tiny, "--audio", SPEECH_WAV, "--output-audio", str(output),
         "--extra-decoding-seconds", "20"],
        capture_output=True, text=True, env=_subprocess_env(), timeout=180,
    )
    assert completed.returncode == 1, completed.stderr
    assert "error: injected EAR-TTS failure" in completed.stderr and "terminate" not in completed.stderr
    assert not output.exists()


def test_mlx_vlm_generate_route_subprocess(tiny, baseline, tmp_path):
    output = tmp_path / "r.wav"
    # mlx-vlm's spelling: the prompt as several words.
    result = run_process(
        [sys.executable, "-m", "mlx_vlm.generate", "--model", tiny, "--audio", SPEECH_WAV,
         "--output-audio", output, "-p", "Be", "concise.", *SHORT],
        output,
    )
    assert result.code == 0, result.err
    assert "Traceback" not in result.err
    assert result.out == baseline.out
    assert_answer_wav(output)
    assert result.wav_bytes == baseline.wav_bytes


def test_same_seed_is_byte_identical_other_seed_differs(tiny, baseline, tmp_path):
    import mlx.core as mx

    # Disturb MLX's global RNG: the turn must only depend on --seed.
    mx.random.seed(1234)
    mx.eval(mx.random.normal((8,)))
    again = run("--model", tiny, "--audio", SPEECH_WAV, "-p", PROMPT, *SHORT, "--seed", "0",
                output=tmp_path / "again.wav")
    other = run("--model", tiny, "--audio", SPEECH_WAV, "-p", PROMPT, *SHORT, "--seed", "1",
                output=tmp_path / "other.wav")
    assert again.code == 0 and other.code == 0, again.err + other.err
    assert again.wav_bytes == baseline.wav_bytes
    assert again.out == baseline.out
    assert other.wav_bytes != baseline.wav_bytes
    assert assert_answer_wav(other.wav) == assert_answer_wav(baseline.wav)


def test_defaults_extra_3_seconds_seed_0_and_auto_progress(tiny, tmp_path):
    # Defaults, on a "terminal": auto draws a bar for a turn over 5 s.
    defaults = run("--model", tiny, "--audio", SPEECH_WAV, output=tmp_path / "defaults.wav",
                   tty=True)
    assert defaults.code == 0, defaults.err
    frames = assert_answer_wav(defaults.wav)
    input_seconds = soundfile.info(str(SPEECH_WAV)).duration
    assert frames * 0.08 == pytest.approx(input_seconds + 3.0, abs=0.25)
    assert has_progress_bar(defaults.err)
    assert "100%" in defaults.err

    # The same values spelled out, stderr not a terminal: identical bytes, no bar.
    explicit = run("--model", tiny, "--audio", SPEECH_WAV, "--extra-decoding-seconds", "3",
                   "--seed", "0", "--progress", "auto", output=tmp_path / "explicit.wav")
    assert explicit.code == 0, explicit.err
    assert not has_progress_bar(explicit.err) and "voice turn" not in explicit.err
    assert explicit.out == defaults.out
    assert explicit.wav_bytes == defaults.wav_bytes


@pytest.mark.parametrize(
    "mode,tty,expect_bar",
    [("on", False, True), ("off", True, False), ("auto", True, False)],
    ids=["on-not-a-tty", "off-on-a-tty", "auto-short-turn-on-a-tty"],
)
def test_progress_modes(tiny, baseline, tmp_path, mode, tty, expect_bar):
    result = run("--model", tiny, "--audio", SPEECH_WAV, "-p", PROMPT, *SHORT,
                 "--progress", mode, output=tmp_path / "r.wav", tty=tty)
    assert result.code == 0, result.err
    assert has_progress_bar(result.err) is expect_bar, result.err
    assert result.out == baseline.out  # the bar goes to stderr only
    assert result.wav_bytes == baseline.wav_bytes


@pytest.mark.parametrize(
    "prompt_args",
    [["-p", "Be", "concise."], ["--prompt", PROMPT], ["--system", PROMPT]],
    ids=["p-several-words", "prompt", "system"],
)
def test_system_prompt_spellings_agree(tiny, baseline, tmp_path, prompt_args):
    result = run("--model", tiny, "--audio", SPEECH_WAV, *prompt_args, *SHORT,
                 output=tmp_path / "r.wav")
    assert result.code == 0, result.err
    assert result.out == baseline.out
    assert result.wav_bytes == baseline.wav_bytes


def test_system_prompt_is_applied(tiny, baseline, tmp_path):
    plain = run("--model", tiny, "--audio", SPEECH_WAV, *SHORT, output=tmp_path / "r.wav")
    assert plain.code == 0, plain.err
    assert assert_answer_wav(plain.wav) == assert_answer_wav(baseline.wav)
    assert plain.wav_bytes != baseline.wav_bytes


def test_prompt_and_system_together_is_a_usage_error(tmp_path):
    output = tmp_path / "r.wav"
    result = run("--model", tmp_path / "no-such-checkpoint", "--audio", SPEECH_WAV,
                 "-p", "a", "--system", "b", output=output)
    assert result.code == 2
    assert len(result.err_lines()) == 1 and "--system" in result.err
    assert not output.exists()


def test_output_alias(tiny, baseline, tmp_path):
    output = tmp_path / "via_output.wav"
    result = run("--model", tiny, "--audio", SPEECH_WAV, "-p", PROMPT, *SHORT,
                 "--output", output)
    assert result.code == 0, result.err
    assert output.read_bytes() == baseline.wav_bytes


@pytest.mark.parametrize(
    "extra_args,mentions",
    [
        (["-n", "5"], "max-tokens"),
        (["--max-tokens", "100"], "max-tokens"),
        (["--temperature", "0.7"], "--temperature"),
        (["--temperature", "0.7", "--top-p", "0.9", "--verbose"], "--top-p"),
    ],
    ids=["n", "max-tokens", "temperature", "several-mlx-vlm-flags"],
)
def test_ignored_options_get_a_note(tiny, baseline, tmp_path, extra_args, mentions):
    result = run("--model", tiny, "--audio", SPEECH_WAV, "-p", PROMPT, *SHORT, *extra_args,
                 output=tmp_path / "r.wav")
    assert result.code == 0, result.err
    notes = [line for line in result.err_lines() if line.startswith("note:")]
    assert len(notes) == 1 and mentions in notes[0] and "ignor" in notes[0], result.err
    assert result.out == baseline.out
    assert result.wav_bytes == baseline.wav_bytes


def test_one_frame_input_without_extra_decoding(tiny, tmp_path):
    """Exactly one 80 ms frame with --extra-decoding-seconds 0 is accepted and answered."""
    source = tmp_path / "one_frame.wav"
    rng = np.random.default_rng(0)
    soundfile.write(str(source), (0.1 * rng.standard_normal(1280)).astype(np.float32), 16_000,
                    subtype="PCM_16")
    result = run("--model", tiny, "--audio", source, "--extra-decoding-seconds", "0",
                 output=tmp_path / "r.wav")
    assert result.code == 0, result.err
    assert result.out.startswith("[user] ")
    assert 1 <= assert_answer_wav(result.wav) <= 3


@pytest.mark.parametrize("name", list(FORMATS))
def test_input_formats_end_to_end(tiny, baseline, tmp_path_factory, tmp_path, name):
    directory = tmp_path_factory.getbasetemp() / "cli-formats"
    directory.mkdir(exist_ok=True)
    source = make_input(directory, name)
    result = run("--model", tiny, "--audio", source, "-p", PROMPT, *SHORT,
                 output=tmp_path / "r.wav")
    assert result.code == 0, result.err
    assert result.out.startswith("[user] ")
    # Same duration once resampled to 16 kHz, so the same timeline length.
    assert assert_answer_wav(result.wav) == assert_answer_wav(baseline.wav)


# --------------------------------------------------------------------------- default model


def test_default_model_is_the_cached_tiny_preset(tiny, baseline, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MLX_VOICECHAT_CACHE", str(cache))

    first = run("--audio", SPEECH_WAV, "-p", PROMPT, *SHORT, output=tmp_path / "first.wav")
    assert first.code == 0, first.err
    model_lines = [line for line in first.err_lines() if line.startswith("[model]")]
    assert len(model_lines) == 1, first.err
    path = Path(model_lines[0].rsplit(": ", 1)[1])
    assert path.parent == cache and (path / "config.json").is_file()
    assert (path / "config.json").read_text() == (tiny / "config.json").read_text()
    assert first.wav_bytes == baseline.wav_bytes  # the tiny preset, seed 0
    stamp = (path / "config.json").stat().st_mtime_ns
    entries = sorted(p.name for p in cache.iterdir())

    from mlx_voicechat_plugin.demo import builder

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached default checkpoint was rebuilt")

    monkeypatch.setattr(builder, "build_checkpoint", no_rebuild)
    second = run("--audio", SPEECH_WAV, "-p", PROMPT, *SHORT, output=tmp_path / "second.wav")
    assert second.code == 0, second.err
    assert [line for line in second.err_lines() if line.startswith("[model]")] == model_lines
    assert (path / "config.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert second.wav_bytes == first.wav_bytes


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "extra_args",
    [["--image", "x.png"], ["--video", "v.mp4"], ["--image", "a.png", "b.png"]],
    ids=["image", "video", "two-images"],
)
def test_image_and_video_are_rejected(tmp_path, extra_args):
    output = tmp_path / "r.wav"
    result = run("--model", tmp_path / "no-such-checkpoint", "--audio", SPEECH_WAV,
                 *extra_args, output=output)
    assert result.code == 2
    assert len(result.err_lines()) == 1, result.err
    assert extra_args[0] in result.err and "Traceback" not in result.err
    assert result.out == ""
    assert not output.exists()


def test_missing_audio_refuses_with_offline_command(tiny, tmp_path):
    for output in (None, tmp_path / "r.wav"):
        result = run("--model", tiny, "-p", "hello", output=output)
        assert result.code == 2
        assert len(result.err_lines()) == 1, result.err
        assert "--audio" in result.err and "mlx-voicechat generate --model" in result.err
        assert result.out == ""
    assert not (tmp_path / "r.wav").exists()


def test_mlx_vlm_generate_hook_without_audio_refuses(tiny, monkeypatch):
    from mlx_voicechat_plugin.registration.shim import install

    install(force=True)  # what the .pth does at start-up (idempotent)
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    monkeypatch.setattr(sys, "argv", ["mlx_vlm.generate", "--model", str(tiny),
                                      "--prompt", "hello"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as caught:
            dispatch.main()
    assert caught.value.code == 2
    assert "--audio" in err.getvalue() and "mlx-voicechat generate" in err.getvalue()


def test_mlx_vlm_chat_refuses_subprocess(tiny):
    result = run_process([sys.executable, "-m", "mlx_vlm", "chat", "--model", tiny])
    assert result.code != 0
    assert "Traceback" not in result.err
    assert "mlx-voicechat generate --model" in result.err and "--audio" in result.err
    assert result.out == ""


def test_mlx_vlm_chat_module_form_refuses_subprocess(tiny):
    result = run_process([sys.executable, "-m", "mlx_vlm.chat", "--model", tiny])
    assert result.code == 2
    assert "Traceback" not in result.err
    assert "mlx-voicechat generate --model" in result.err
    assert "Model loaded" not in result.out


def test_console_script_usage():
    assert cli_main([]) == 2
    assert cli_main(["--help"]) == 0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli_main(["chat"]) == 2
    assert "unknown command" in err.getvalue()


# --------------------------------------------------------------------------- bad input


def _wav(path: Path, samples, subtype="PCM_16") -> Path:
    soundfile.write(str(path), np.asarray(samples), 16_000, subtype=subtype, format="WAV")
    return path


def _nonfinite(path: Path, value: float) -> Path:
    samples = np.zeros(8_000, np.float32)
    samples[100] = value
    return _wav(path, samples, subtype="FLOAT")


def _text(path: Path) -> Path:
    path.write_text("definitely not RIFF\n")
    return path


#: case -> (make input, extra argv, output name or None for the default, words in the error)
BAD = {
    "missing-file": (lambda d, L: d / "missing.wav", [], None, "no such file"),
    "directory": (lambda d, L: d, [], None, "directory"),
    "text-named-wav": (lambda d, L: _text(d / "notes.wav"), [], None, "not a readable audio"),
    "empty-wav": (lambda d, L: _wav(d / "empty.wav", np.zeros(0, np.int16)), [], None,
                  "no audio samples"),
    "shorter-than-a-frame": (lambda d, L: _wav(d / "short.wav", np.zeros(1279, np.int16)),
                             ["--extra-decoding-seconds", "0"], None, "80 ms frame"),
    "nan": (lambda d, L: _nonfinite(d / "nan.wav", np.nan), [], None, "NaN"),
    "inf": (lambda d, L: _nonfinite(d / "inf.wav", np.inf), [], None, "infinite"),
    "output-not-wav": (lambda d, L: SPEECH_WAV, [], "answer.mp3", ".wav"),
    "output-dir-missing": (lambda d, L: SPEECH_WAV, [], "missing/answer.wav", "does not exist"),
    "extra-negative": (lambda d, L: SPEECH_WAV, ["--extra-decoding-seconds", "-1"], None,
                       "--extra-decoding-seconds"),
    "extra-over-600": (lambda d, L: SPEECH_WAV, ["--extra-decoding-seconds", "600.5"], None,
                       "600"),
    "extra-nan": (lambda d, L: SPEECH_WAV, ["--extra-decoding-seconds", "nan"], None,
                  "--extra-decoding-seconds"),
    "over-20-minutes": (lambda d, L: L["20min1s"], [], None, "20 minutes"),
    "negative-seed": (lambda d, L: SPEECH_WAV, ["--seed", "-1"], None, "--seed"),
}


@pytest.mark.parametrize("existing", [False, True], ids=["no-output-yet", "output-exists"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_fails_early_with_one_line(tmp_path, long_inputs, case, existing):
    make, extra_args, output_name, words = BAD[case]
    inputs = tmp_path / "in"
    inputs.mkdir()
    source = make(inputs, long_inputs)
    output = tmp_path / (output_name or "answer.wav")
    if existing and output.parent.is_dir():
        output.write_bytes(b"previous answer")
    before = sorted(p.name for p in tmp_path.iterdir())

    # A model path that does not exist: failing on it would mean the input was accepted.
    result = run("--model", tmp_path / "no-such-checkpoint", "--audio", source, *extra_args,
                 output=output)

    assert result.code == 2  # every bad input is a usage error (exit_codes)
    lines = result.err_lines()
    assert len(lines) == 1, result.err
    assert words in lines[0], lines[0]
    assert "Traceback" not in result.err
    assert "checkpoint" not in result.err  # rejected before the model is looked at
    assert result.out == ""
    if existing and output.parent.is_dir():
        assert output.read_bytes() == b"previous answer"
    else:
        assert not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "case,extra_args",
    [
        ("exactly-20-minutes", []),
        ("extra-600", ["--extra-decoding-seconds", "600"]),
        ("extra-0", ["--extra-decoding-seconds", "0"]),
    ],
)
def test_limits_are_inclusive(tmp_path, long_inputs, case, extra_args):
    """At the limits the input is accepted: the command gets as far as the (missing) model."""
    source = long_inputs["20min"] if case == "exactly-20-minutes" else SPEECH_WAV
    output = tmp_path / "answer.wav"
    result = run("--model", tmp_path / "no-such-checkpoint", "--audio", source, *extra_args,
                 output=output)
    assert result.code == 2  # a --model that is not a checkpoint is a usage error
    assert len(result.err_lines()) == 1, result.err
    assert "no-such-checkpoint" in result.err and "Traceback" not in result.err
    assert not output.exists()


def test_console_script_help_lists_the_commands(capsys):
    from mlx_voicechat_plugin.cli.main import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("generate", "serve", "demo"):
        assert f"\n  {command} " in out
    assert main([]) == 2


@pytest.mark.parametrize("model", ["mlx-community/NemotronLabs-VoiceChat-11B-4bit", "/nonexistent/dir"])
def test_mlx_vlm_generate_with_our_options_and_a_missing_model_gets_our_error(model, monkeypatch, tmp_path):
    """A checkpoint not downloaded (or a mistyped path) with this package's options used to
    reach mlx-vlm's own CLI: 59 lines of its usage, "unrecognized arguments: --output-audio".
    The options route the command here, whose error names the checkpoint."""
    from mlx_voicechat_plugin.registration.shim import install

    install(force=True)
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    monkeypatch.setattr(sys, "argv", ["mlx_vlm.generate", "--model", model, "--audio", str(SPEECH_WAV),
                                      f"--output-audio={tmp_path / 'r.wav'}", "-p", "Be concise."])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as caught:
            dispatch.main()
    assert caught.value.code == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {model}: no such checkpoint directory"), err.getvalue()
    assert not (tmp_path / "r.wav").exists()


@pytest.mark.parametrize("config", ["{not json", "[1, 2]", '{"hidden_size": 8}'],
                         ids=["corrupt", "not-an-object", "no-model-type"])
def test_mlx_vlm_generate_with_our_options_and_an_unreadable_config_gets_our_error(config, monkeypatch, tmp_path):
    """A checkpoint whose config.json is unreadable (a truncated download) or names no
    model_type, used with this package's options: our one-line error naming the file, not
    mlx-vlm's usage text. A config naming another family still goes to mlx-vlm (below)."""
    from mlx_voicechat_plugin.registration.shim import install

    install(force=True)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(config)
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    monkeypatch.setattr(sys, "argv", ["mlx_vlm.generate", "--model", str(checkpoint), "--audio", str(SPEECH_WAV),
                                      f"--output-audio={tmp_path / 'r.wav'}"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as caught:
            dispatch.main()
    assert caught.value.code == 2, err.getvalue()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {checkpoint}"), err.getvalue()
    assert not (tmp_path / "r.wav").exists()


def test_a_prompt_with_an_undecodable_byte_is_a_usage_error(tiny, tmp_path):
    """``-p $'caf\\xff'`` (a byte that is not UTF-8: a lone surrogate in Python's argv): exit
    2 with one line naming the prompt, before the model loads (it was exit 1 from deep in
    the prompt's tokenisation)."""
    from mlx_voicechat_plugin.cli.main import main as cli_main

    output = tmp_path / "r.wav"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["generate", "--model", str(tiny), "--audio", str(SPEECH_WAV), "--output-audio", str(output),
                         "-p", "caf\udcff"])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "the system prompt is not valid UTF-8 text" in lines[0], err.getvalue()
    assert not output.exists()


def test_generate_only_options_are_ours_alone():
    """Each routed option is one our parser takes and mlx-vlm's does not (read from its
    ``--help`` with the shim off): routing never takes a command mlx-vlm could run."""
    from mlx_voicechat_plugin.cli.generate import build_parser
    from mlx_voicechat_plugin.registration.command_hooks import GENERATE_ONLY_OPTIONS

    ours = {option for action in build_parser()._actions for option in action.option_strings}
    completed = subprocess.run([sys.executable, "-m", "mlx_vlm.generate", "--help"], capture_output=True, text=True,
                               env={**_subprocess_env(), "MLX_VOICECHAT_DISABLE_SHIM": "1"}, timeout=120)
    assert completed.returncode == 0 and "--max-tokens" in completed.stdout, completed.stderr
    for option in GENERATE_ONLY_OPTIONS:
        assert option in ours, option
        assert re.search(rf"(^|[\s,\[]){re.escape(option)}([\s=,\]]|$)", completed.stdout, re.M) is None, option


def test_mlx_vlm_generate_with_our_options_and_another_model_family_stays_with_mlx_vlm(tmp_path, monkeypatch):
    """A checkpoint of another family (here a Qwen2-VL config) goes to mlx-vlm's own CLI even
    with our options: our CLI would describe it as a speech model."""
    from mlx_voicechat_plugin.registration.shim import install

    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen2_vl"}')
    install(force=True)
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    monkeypatch.setattr(sys, "argv", ["mlx_vlm.generate", "--model", str(other), "--prompt", "hi", "--stream"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as caught:
            dispatch.main()
    assert caught.value.code == 2
    assert "unrecognized arguments: --stream" in err.getvalue() and "--audio is required" not in err.getvalue()
