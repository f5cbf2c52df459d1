"""The bundled browser page (GET /voicechat) in a real headless Chromium against a real server.

Chromium's fake capture device plays the bundled question (as a 48 kHz PCM16 WAV) into
getUserMedia; Selenium holds the talk button; the page exposes its progress on
``<body data-state data-*-events>`` and ``window.voicechat``. A screenshot of the finished
turn is saved to ``artifacts/browser_page.png``. Skipped only when Chromium / chromedriver
(Debian ``chromium`` / ``chromium-driver``) or Selenium are not installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import SPEECH_WAV, SYSTEM_PROMPT
from .test_client_support import serve  # noqa: F401 - fixture

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

if not (Path(CHROMIUM).exists() or shutil.which("chromium")) or not (Path(CHROMEDRIVER).exists() or shutil.which("chromedriver")):
    pytest.skip(
        "Chromium and chromedriver are not installed (apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )
pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium, in the dev extra)")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def fake_capture_wav(tmp_path_factory) -> Path:
    """The question at 48 kHz mono PCM16, then 1 s of silence (Chromium loops the file)."""
    import numpy as np
    import soundfile

    from mlx_voicechat_plugin.runtime.audio_io import read_audio, to_pcm16

    speech = read_audio(SPEECH_WAV, 48_000)
    path = tmp_path_factory.mktemp("fake-mic") / "question48k.wav"
    samples = np.concatenate([speech, np.zeros(48_000, np.float32)])
    soundfile.write(str(path), to_pcm16(samples), 48_000, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def browser(fake_capture_wav, tmp_path_factory):
    options = Options()
    options.binary_location = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    for argument in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={fake_capture_wav}",
        "--autoplay-policy=no-user-gesture-required",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-default-apps", "--disable-extensions", "--no-first-run", "--no-default-browser-check",
        "--metrics-recording-only", "--window-size=900,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver_path = CHROMEDRIVER if Path(CHROMEDRIVER).exists() else shutil.which("chromedriver")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _page_state(driver) -> dict:
    return driver.execute_script(
        "const v = window.voicechat; return {state: v.state, counters: v.counters, lastError: v.lastError,"
        " url: v.url, capture: v.captureMethod || null, kind: document.body.dataset.errorKind,"
        " audioScheduled: Number(document.body.dataset.audioScheduled)};"
    )


def _talk(driver, seconds: float) -> None:
    button = driver.find_element(By.ID, "talk")
    ActionChains(driver).click_and_hold(button).pause(seconds).release().perform()


def _wait_finished(driver, timeout: float = 60.0) -> dict:
    WebDriverWait(driver, timeout).until(
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") in ("done", "error")
    )
    return _page_state(driver)


def _severe_console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _open_settings(driver) -> None:
    if not driver.find_element(By.ID, "settings").get_attribute("open"):
        driver.find_element(By.CSS_SELECTOR, "#settings summary").click()


def test_press_to_talk_turn(serve, browser):  # noqa: F811
    server = serve()
    browser.get(server.http + "/voicechat")
    assert browser.title == "VoiceChat"
    _severe_console_errors(browser)  # drop anything logged while loading
    _open_settings(browser)
    browser.find_element(By.ID, "prompt").send_keys(SYSTEM_PROMPT)
    _talk(browser, 1.5)
    state = _wait_finished(browser)
    counters = state["counters"]
    assert state["state"] == "done", state
    assert state["url"] == server.ws("/v1/realtime")
    assert state["capture"] == "audioworklet"
    assert state["lastError"] is None and state["kind"] == ""
    assert counters["appendsSent"] >= 12  # ~1.5 s of 80 ms appends (queued until session.updated)
    assert counters["transcriptEvents"] + counters["textEvents"] > 0
    assert counters["audioEvents"] >= counters["appendsSent"]  # one 80 ms answer frame per input frame
    assert counters["audioScheduled"] == counters["audioEvents"] == state["audioScheduled"]
    assert abs(counters["scheduledSeconds"] - 0.08 * counters["audioEvents"]) < 1e-6
    answer = browser.find_element(By.CSS_SELECTOR, "#log .turn .bot").text
    assert answer.startswith("ASSISTANT") or answer.lower().startswith("assistant")
    assert browser.find_element(By.ID, "status").text == "Done"
    assert _severe_console_errors(browser) == []
    ARTIFACTS.mkdir(exist_ok=True)
    browser.find_element(By.TAG_NAME, "body").click()  # drop focus rings
    browser.save_screenshot(str(ARTIFACTS / "browser_page.png"))


def test_api_key_field_and_prefix(serve, browser):  # noqa: F811
    """With --api-key (and an --api-prefix): a wrong key shows an auth error; the right key,
    carried in the bearer subprotocol, connects and completes a turn."""
    server = serve(api_key="browser-s3cret", api_prefix="/voice")
    browser.get(server.http + "/voice/voicechat")
    _open_settings(browser)
    key = browser.find_element(By.ID, "apikey")
    key.send_keys("wrong-key")
    _talk(browser, 0.4)
    state = _wait_finished(browser)
    assert state["state"] == "error" and state["kind"] == "auth", state
    message = browser.find_element(By.ID, "error").text
    assert "API key is wrong" in message and browser.find_element(By.ID, "error").is_displayed()
    assert state["url"] == server.ws("/voice/v1/realtime")

    key.clear()
    key.send_keys("browser-s3cret")
    _talk(browser, 0.8)
    state = _wait_finished(browser)
    assert state["state"] == "done", state
    assert state["kind"] == "" and not browser.find_element(By.ID, "error").is_displayed()
    assert state["counters"]["audioEvents"] > 0 and state["counters"]["audioScheduled"] > 0

    key.clear()  # no key at all: the page asks for one
    _talk(browser, 0.3)
    state = _wait_finished(browser)
    assert state["kind"] == "auth" and "requires an API key" in browser.find_element(By.ID, "error").text


def test_busy_server_and_open_mic(serve, browser):  # noqa: F811
    from websockets.sync.client import connect

    server = serve()
    browser.get(server.http + "/voicechat")
    with connect(server.ws()) as holder:
        json.loads(holder.recv())
        holder.send(json.dumps({"type": "session.update", "session": {}}))
        assert json.loads(holder.recv())["type"] == "session.updated"
        _talk(browser, 0.3)
        state = _wait_finished(browser)
        assert state["state"] == "error" and state["kind"] == "busy", state
        assert "busy" in browser.find_element(By.ID, "error").text
    # The slot is free again: the open-mic toggle streams until clicked again.
    from .test_client_support import wait_slot_free

    wait_slot_free(server.engine)
    toggle = browser.find_element(By.ID, "openmic")
    toggle.click()
    WebDriverWait(browser, 30).until(lambda d: _page_state(d)["counters"]["appendsSent"] >= 6)
    assert toggle.get_attribute("aria-pressed") == "true"
    toggle.click()
    state = _wait_finished(browser)
    assert state["state"] == "done" and state["kind"] == "", state
    assert state["counters"]["audioEvents"] > 0


def test_page_resampler_and_wire_codecs(serve, browser):  # noqa: F811
    """The page's 48 kHz -> 16 kHz resampler keeps a tone's pitch and level, its PCM16 codec
    matches the Python clients', and its bearer subprotocol decodes on the server side."""
    import base64

    import numpy as np

    from mlx_voicechat_plugin.clients.protocol import encode_pcm16
    from mlx_voicechat_plugin.server.security import presented_key

    server = serve()
    browser.get(server.http + "/voicechat")
    result = browser.execute_script("""
        const {Resampler, encodePcm16, decodePcm16, base64url} = window.voicechat.internals;
        const r = new Resampler(48000, 16000), parts = [];
        const tone = new Float32Array(48000);
        for (let i = 0; i < tone.length; i++) tone[i] = 0.5 * Math.sin(2 * Math.PI * 1000 * i / 48000);
        for (let i = 0; i < tone.length; i += 441) parts.push(...r.push(tone.subarray(i, i + 441)));
        parts.push(...r.flush());
        const values = Float32Array.from([-1.5, -1, -0.5, 0, 0.5, 0.99999, 1, 2, 1e-5]);
        return {resampled: parts, encoded: encodePcm16(values),
                decoded: Array.from(decodePcm16(encodePcm16(values))), key: base64url("s3cret-\\u043a\\u043b\\u044e\\u0447\\u2713")};
    """)
    audio = np.asarray(result["resampled"], dtype=np.float64)
    assert abs(audio.shape[0] - 16000) <= 40
    middle = audio[2000:14000]
    assert abs(np.argmax(np.abs(np.fft.rfft(middle))) * 16000 / middle.shape[0] - 1000) < 2
    assert abs(np.max(np.abs(middle)) - 0.5) < 0.01
    values = np.array([-1.5, -1, -0.5, 0, 0.5, 0.99999, 1, 2, 1e-5], dtype=np.float32)
    assert result["encoded"] == encode_pcm16(values)
    assert result["decoded"] == (np.frombuffer(base64.b64decode(encode_pcm16(values)), "<i2") / 32768).tolist()
    assert presented_key(None, ["mlx-voicechat", "mlx-voicechat.bearer." + result["key"]]) == "s3cret-ключ✓"
    assert "=" not in result["key"]  # padding is not a valid token character in a subprotocol
