"""``mlx_voicechat_plugin.environment``: every on/off switch reads one way, a bad value of
any ``MLX_VOICECHAT_*`` setting is a clear error before a model loads (library and command
lines), and every variable the package reads is classified."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mlx_voicechat_plugin import environment
from mlx_voicechat_plugin.environment import EnvironmentSettingError, flag
from mlx_voicechat_plugin.settings import check

PACKAGE = Path(environment.__file__).resolve().parent
#: Variables that are not on/off switches, each checked by its own reader.
OTHER_SETTINGS = {
    "MLX_VOICECHAT_COMPILE",  # 1 / 0 / auto (runtime.compiled)
    "MLX_VOICECHAT_BATCH_LANES",  # on / off / stage names (runtime.stages.lanes)
    "MLX_VOICECHAT_NATIVE_ISA",  # auto / a kernel variant (checked by accel.cpu.native.build when it builds)
    "MLX_VOICECHAT_PROFILE_FRAMES",  # a file path
    "MLX_VOICECHAT_API_KEY",  # a secret
    "MLX_VOICECHAT_CACHE",  # a directory
}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in (*environment.SWITCHES, *OTHER_SETTINGS):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", ["1", "true", "YES", " On ", "tRuE"])
def test_on_spellings(monkeypatch, value):
    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", value)
    assert flag("MLX_VOICECHAT_CPU_SPLIT", False) is True


@pytest.mark.parametrize("value", ["0", "false", "No", " OFF\t"])
def test_off_spellings(monkeypatch, value):
    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", value)
    assert flag("MLX_VOICECHAT_CPU_SPLIT", True) is False


def test_unset_or_empty_is_the_default(monkeypatch):
    assert flag("MLX_VOICECHAT_CPU_SPLIT", True) is True and flag("MLX_VOICECHAT_CPU_SPLIT", False) is False
    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", "  ")
    assert flag("MLX_VOICECHAT_CPU_SPLIT", True) is True and flag("MLX_VOICECHAT_CPU_SPLIT", False) is False


@pytest.mark.parametrize("value", ["garbage", "2", "onn", "enabled", "-1"])
def test_any_other_value_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", value)
    with pytest.raises(EnvironmentSettingError, match=rf"MLX_VOICECHAT_CPU_SPLIT={value!r}: expected 1, true"):
        flag("MLX_VOICECHAT_CPU_SPLIT", True)


def test_the_readers_use_it(monkeypatch):
    """Each switch's reader refuses a bad value instead of guessing (``garbage`` used to
    mean "on" for the split, "off" for nothing, "on" for the rest)."""
    from mlx_voicechat_plugin import accel
    from mlx_voicechat_plugin.accel.cpu import parallel
    from mlx_voicechat_plugin.accel.cpu.native import calibration
    from mlx_voicechat_plugin.model import pinning
    from mlx_voicechat_plugin.runtime.streaming import profile

    readers = {
        "MLX_VOICECHAT_CPU_SPLIT": parallel.split_enabled,
        "MLX_VOICECHAT_CPU_ACCEL": accel.enabled,
        "MLX_VOICECHAT_NATIVE_MEASURE": calibration.measuring_enabled,
        "MLX_VOICECHAT_PIN_F32": pinning.pinning_enabled,
        "MLX_VOICECHAT_PROFILE_STAGES": profile.sub_stages_requested,
    }
    for name, reader in readers.items():
        monkeypatch.setenv(name, "0")
        assert reader() is False, name
        monkeypatch.setenv(name, "garbage")
        with pytest.raises(EnvironmentSettingError, match=name):
            reader()
        monkeypatch.delenv(name)


def test_every_variable_the_package_reads_is_classified():
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names |= set(re.findall(r'"(MLX_VOICECHAT_[A-Z0-9_]+)"', path.read_text()))
    assert names, "no variable found: the scan is broken"
    unclassified = names - set(environment.SWITCHES) - OTHER_SETTINGS
    assert not unclassified, f"add to environment.SWITCHES (on/off) or to this test's OTHER_SETTINGS: {unclassified}"
    assert set(environment.SWITCHES) <= names


def test_check_passes_on_a_clean_environment_and_on_good_values(monkeypatch):
    check()
    for name in environment.SWITCHES:
        monkeypatch.setenv(name, "off")
    monkeypatch.setenv("MLX_VOICECHAT_COMPILE", "auto")
    monkeypatch.setenv("MLX_VOICECHAT_BATCH_LANES", "codec")
    check()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MLX_VOICECHAT_DISABLE_SHIM", "nah", "MLX_VOICECHAT_DISABLE_SHIM='nah'"),
        ("MLX_VOICECHAT_NATIVE", "of", "MLX_VOICECHAT_NATIVE='of'"),
        ("MLX_VOICECHAT_COMPILE", "sometimes", "MLX_VOICECHAT_COMPILE must be 1, 0 or auto"),
        ("MLX_VOICECHAT_BATCH_LANES", "vocoder", "unknown stage"),
    ],
)
def test_check_refuses_each_kind_of_bad_value(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(EnvironmentSettingError, match=re.escape(message) if "'" in message else message):
        check()


def test_loading_refuses_a_bad_switch_before_reading_the_checkpoint(monkeypatch, tmp_path):
    """``loading.load`` checks first: even a directory that is no checkpoint gets the
    setting's error, not a checkpoint error."""
    from mlx_voicechat_plugin.loading import load

    monkeypatch.setenv("MLX_VOICECHAT_PIN_F32", "maybe")
    with pytest.raises(EnvironmentSettingError, match="MLX_VOICECHAT_PIN_F32='maybe'"):
        load(tmp_path)


def test_mlx_vlm_load_refuses_a_bad_switch_for_our_model(tiny, monkeypatch):
    import mlx_vlm

    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", "sometimes")
    with pytest.raises(EnvironmentSettingError, match="MLX_VOICECHAT_CPU_SPLIT"):
        mlx_vlm.load(str(tiny))


def test_generate_exits_2_with_one_line_before_loading(tiny, monkeypatch, capsys, tmp_path):
    from mlx_voicechat_plugin.cli import generate

    loads = []
    monkeypatch.setattr("mlx_voicechat_plugin.loading.load", lambda *a, **k: loads.append(a))
    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", "garbage")
    audio = Path(__file__).parent / "data" / "question.wav"
    code = generate.main(["--model", str(tiny), "--audio", str(audio), "--output-audio", str(tmp_path / "a.wav")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip() == "error: MLX_VOICECHAT_CPU_SPLIT='garbage': expected 1, true, yes or on to switch it on, or 0, false, no or off to switch it off"
    assert not loads and not (tmp_path / "a.wav").exists()


def test_serve_exits_2_before_loading(tiny, monkeypatch, capsys):
    from mlx_voicechat_plugin.server import cli as server_cli

    loads = []
    monkeypatch.setattr("mlx_voicechat_plugin.loading.load", lambda *a, **k: loads.append(a))
    monkeypatch.setenv("MLX_VOICECHAT_NATIVE", "nope")
    code = server_cli.main(["--model", str(tiny), "--port", "8765"], hard_exit=False)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: MLX_VOICECHAT_NATIVE='nope'" in err and err.count("\n") <= 2 and not loads


def test_a_very_long_value_is_cut_in_the_message(monkeypatch):
    monkeypatch.setenv("MLX_VOICECHAT_CPU_SPLIT", "x" * 100_000)
    with pytest.raises(EnvironmentSettingError) as caught:
        flag("MLX_VOICECHAT_CPU_SPLIT", True)
    assert len(str(caught.value)) < 300 and "100,000 characters" in str(caught.value)
    monkeypatch.delenv("MLX_VOICECHAT_CPU_SPLIT")
    monkeypatch.setenv("MLX_VOICECHAT_BATCH_LANES", "y" * 100_000)
    with pytest.raises(EnvironmentSettingError) as caught:
        check()
    assert len(str(caught.value)) < 500
