"""The system prompt's token limit: 512 by default everywhere, configurable up to 4,096
(``StreamingOptions.max_prompt_tokens``, the offline turn's ``max_prompt_tokens``,
``--max-prompt-tokens`` of generate and serve), checked before any audio runs."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mlx_voicechat_plugin.prompt_limit import (
    MAX_PROMPT_TOKENS,
    PROMPT_TOKENS_CEILING,
    prompt_chars_limit,
)
from mlx_voicechat_plugin.runtime.streaming import StreamingOptions
from mlx_voicechat_plugin.runtime.timeline import prompt_ids
from mlx_voicechat_plugin.server.openai import fields
from mlx_voicechat_plugin.server.settings import ServerSettings

from .conftest import SPEECH_WAV
from .test_openai_realtime import GAClient
from .test_server_support import Client, ServerHandle, server_settings

#: The tiny demo tokenizer reads a run of "a" as one token per character.
LONG = 520
LONG_PROMPT = "a" * LONG


def test_the_default_limit_is_the_same_everywhere():
    from mlx_voicechat_plugin.runtime import offline

    assert MAX_PROMPT_TOKENS == offline.MAX_PROMPT_TOKENS == 512
    assert StreamingOptions().max_prompt_tokens == ServerSettings(model_id="m").max_prompt_tokens == 512
    assert fields.MAX_PROMPT_CHARS == prompt_chars_limit() == 4096


@pytest.mark.parametrize("value", [0, -1, PROMPT_TOKENS_CEILING + 1, True, 1.0, "600", None])
def test_a_bad_limit_is_refused(value):
    with pytest.raises((TypeError, ValueError), match="max_prompt_tokens"):
        StreamingOptions(max_prompt_tokens=value)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        ServerSettings(model_id="m", max_prompt_tokens=value)


def test_the_tokenizer_reads_the_long_prompt_as_expected(models):
    _, tokenizer, *_ = models("tiny")
    assert len(tokenizer.encode(LONG_PROMPT, add_special_tokens=False)) == LONG


def test_prompt_ids_honours_the_limit_to_the_token(models):
    ours, tokenizer, *_ = models("tiny")
    config = ours.config
    with pytest.raises(ValueError, match=f"{LONG} tokens; at most 512"):
        prompt_ids(config, tokenizer, LONG_PROMPT)
    with pytest.raises(ValueError, match=f"{LONG} tokens; at most {LONG - 1}"):
        prompt_ids(config, tokenizer, LONG_PROMPT, LONG - 1)
    assert len(prompt_ids(config, tokenizer, LONG_PROMPT, LONG)) == LONG + 2  # BOS, EOS
    # the character bound is refused without tokenizing, and says both bounds
    with pytest.raises(ValueError, match="4097 characters; at most 4096 characters and 512 tokens"):
        prompt_ids(config, tokenizer, "b" * 4097)
    with pytest.raises(ValueError, match="at most 16"):
        prompt_ids(config, tokenizer, "b" * 17, 2)


def test_a_raised_limit_runs_the_longer_prompt_offline_and_streaming(models, speech_16k):
    ours, tokenizer, *_ = models("tiny")
    turn = ours.create_session(tokenizer)
    with pytest.raises(ValueError, match="tokens"):
        turn.generate(speech_16k[:2560], system_prompt=LONG_PROMPT, extra_decoding_seconds=0)
    result = turn.generate(speech_16k[:2560], system_prompt=LONG_PROMPT, extra_decoding_seconds=0, max_prompt_tokens=LONG)
    assert result.audio.shape[0] > 0
    with pytest.raises(ValueError, match="tokens"):
        ours.create_streaming_session(processor=tokenizer, system_prompt=LONG_PROMPT)
    options = StreamingOptions(system_prompt=LONG_PROMPT, max_prompt_tokens=LONG)
    session = ours.create_streaming_session(options, processor=tokenizer, prefill=False)
    assert len(session.prompt_ids) == LONG + 2
    session.cancel()


@pytest.mark.parametrize("value", ["0", "4097", "-3"])
def test_generate_refuses_a_bad_limit_before_loading(value, tmp_path, capsys):
    from mlx_voicechat_plugin.cli.generate import main

    code = main(["--model", str(tmp_path / "missing"), "--audio", str(SPEECH_WAV), "--output-audio",
                 str(tmp_path / "o.wav"), "--max-prompt-tokens", value])
    err = capsys.readouterr().err
    assert code == 2 and "--max-prompt-tokens must be between 1 and 4096" in err, err


@pytest.mark.parametrize("value", ["0", "4097"])
def test_serve_refuses_a_bad_limit(value, capsys):
    from mlx_voicechat_plugin.server.cli import main

    assert main(["--max-prompt-tokens", value], hard_exit=False) == 2
    assert "--max-prompt-tokens must be between 1 and 4096" in capsys.readouterr().err


@pytest.fixture(scope="module")
def raised(tiny, engine):
    with ServerHandle(server_settings(tiny, max_prompt_tokens=LONG), engine) as handle:
        yield handle


@pytest.mark.usefixtures("slot_released")
def test_the_server_opens_a_prompt_up_to_its_limit(server, raised):
    with Client(server.ws_url) as client:  # the default server: refused, the connection stays
        client.created()
        client.send({"type": "session.update", "session": {"system_prompt": LONG_PROMPT}})
        assert "at most 512" in client.recv_error("session_initialization_failed")
    with Client(raised.ws_url) as client:
        client.created()
        client.send({"type": "session.update", "session": {"system_prompt": LONG_PROMPT + "a"}})
        assert f"at most {LONG}" in client.recv_error("session_initialization_failed")
        client.send({"type": "session.update", "session": {"system_prompt": LONG_PROMPT}})
        client.recv_type("session.updated", timeout=60)
        client.send({"type": "session.cancel"})
        client.until_closed()
    raised.wait_slot_free()


@pytest.mark.usefixtures("slot_released")
def test_the_openai_dialect_bounds_instructions_by_the_servers_limit(server, raised):
    long_text = "i" * (fields.MAX_PROMPT_CHARS + 1)
    with GAClient(server.ws_url + "?model=m") as client:
        client.recv()
        client.send({"type": "session.update", "session": {"instructions": long_text}})
        error = client.error()
        assert (error["code"], error["param"]) == ("string_above_max_length", "session.instructions")
    with GAClient(raised.ws_url + "?model=m") as client:
        client.recv()
        client.send({"type": "session.update", "session": {"instructions": "i" * prompt_chars_limit(LONG)}})
        assert client.until("session.updated")[-1]["session"]["instructions"] == "i" * prompt_chars_limit(LONG)
        client.send({"type": "session.update", "session": {"instructions": LONG_PROMPT}})
        client.until("session.updated")
        # the model session opens with the 520-token prompt on the first audio
        client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(np.zeros(4800, "<i2").tobytes()).decode()})
        client.send({"type": "session.update", "event_id": "alive", "session": {}})
        assert all(event["type"] != "error" for event in client.until("session.updated"))
    raised.wait_slot_free()
