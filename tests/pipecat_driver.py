"""Drive pipecat's ``OpenAIRealtimeLLMService`` against a running server (not a test module:
``tests/test_openai_pipecat.py`` runs it with the Python of a separate pipecat venv).

Usage: ``python tests/pipecat_driver.py WS_BASE_URL WAV_24K_PCM16_PATH`` where WS_BASE_URL is
``ws://HOST:PORT/v1/realtime``. Prints one JSON line: the server event types pipecat parsed,
any that it could not parse, the frames the service pushed, and pipecat errors.
"""

from __future__ import annotations

import asyncio
import json
import sys
import wave


async def main(url: str, wav_path: str) -> dict:
    from pipecat.frames.frames import EndFrame, ErrorFrame, InputAudioRawFrame, LLMContextFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime import events, llm

    parsed: list[str] = []
    unparsed: list[str] = []
    original = events.parse_server_event

    def recording_parse(message):
        event = original(message)  # raises on a malformed known event
        kind = json.loads(message)["type"]
        (parsed if event is not None else unparsed).append(kind)
        return event

    llm.events.parse_server_event = recording_parse
    frames: dict[str, int] = {}
    errors: list[str] = []

    class Recorder(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            name = type(frame).__name__
            frames[name] = frames.get(name, 0) + 1
            if isinstance(frame, ErrorFrame):
                errors.append(str(frame.error)[:300])
            await self.push_frame(frame, direction)

    properties = events.SessionProperties(
        instructions="Be concise and answer in one sentence.",
        max_output_tokens=20,
        audio=events.AudioConfiguration(
            input=events.AudioInput(
                format=events.PCMAudioFormat(),
                transcription=events.InputAudioTranscription(model="gpt-4o-transcribe"),
                turn_detection=events.TurnDetection(silence_duration_ms=400),
            ),
            output=events.AudioOutput(format=events.PCMAudioFormat()),
        ),
    )
    service = llm.OpenAIRealtimeLLMService(
        api_key="sk-local-test",
        base_url=url,
        settings=llm.OpenAIRealtimeLLMService.Settings(session_properties=properties),
    )
    pipeline = Pipeline([Recorder(), service, Recorder()])
    task = PipelineTask(pipeline, params=PipelineParams(audio_in_sample_rate=24000, audio_out_sample_rate=24000), enable_rtvi=False)

    with wave.open(wav_path, "rb") as source:
        pcm = source.readframes(source.getnframes())
    chunk = 24000 * 2 // 50  # 20 ms

    async def feed():
        await asyncio.sleep(1.0)
        await task.queue_frame(LLMContextFrame(context=LLMContext(messages=[{"role": "user", "content": "Hello"}])))
        for start in range(0, len(pcm), chunk):
            await task.queue_frame(InputAudioRawFrame(audio=pcm[start : start + chunk], sample_rate=24000, num_channels=1))
            await asyncio.sleep(0.005)
        for _ in range(300):
            if "response.done" in parsed and "conversation.item.input_audio_transcription.completed" in parsed:
                break
            await asyncio.sleep(0.05)
        await task.queue_frame(EndFrame())

    runner = PipelineRunner(handle_sigint=False)
    await asyncio.wait_for(asyncio.gather(runner.run(task), feed()), 90)
    return {"parsed": parsed, "unparsed": unparsed, "frames": frames, "errors": errors}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
