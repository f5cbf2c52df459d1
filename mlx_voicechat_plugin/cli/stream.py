"""``generate --stream``: drive the online session frame by frame (spec "Online session").

Pushes the input plus the extra silence in 80 ms frames, prints the assistant text as
frames produce it (an ``[assistant]`` line), then ``[user]`` and ``[function]`` lines, returns the concatenated
audio, and with ``--profile`` prints the summary JSON after dropping 5 cold frames.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from .output import for_stream, labelled

COLD_FRAMES = 5


def run_stream(model, tokenizer, waveform: np.ndarray, args, system_prompt: str | None) -> np.ndarray:
    """Stream ``waveform`` (16 kHz mono, extra silence included); return 22.05 kHz samples.

    Raises:
        ContextLimitError: ``--max-streaming-seconds`` was reached (reported by the caller).
    """
    from ..runtime.streaming import StreamingOptions

    options = StreamingOptions(
        system_prompt=system_prompt,
        seed=args.seed,
        max_streaming_seconds=args.max_streaming_seconds,
        use_language_cache=not args.no_language_cache,
        profile=args.profile,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    session = model.create_streaming_session(options, processor=tokenizer)
    frame = session.frame_samples
    audio: list[np.ndarray] = []
    transcript = function = ""
    printed = False

    def handle(events) -> None:
        nonlocal transcript, function, printed
        for event in events:
            if event.kind == "audio":
                audio.append(event.samples)
            elif event.kind == "assistant_text_delta":
                if not printed:
                    sys.stdout.write("[assistant] ")
                sys.stdout.write(for_stream(event.delta, sys.stdout))
                sys.stdout.flush()
                printed = True
            elif event.kind == "user_transcript_delta":
                transcript = event.text
            elif event.kind == "function_delta":
                function = event.text

    try:
        for start in range(0, waveform.shape[0], frame):
            handle(session.push_audio(waveform[start : start + frame], 16_000))
        handle(session.flush(pad_partial=True))
    finally:
        if printed:
            sys.stdout.write("\n")
    print(labelled("user", transcript, sys.stdout))
    if function:
        print(labelled("function", function, sys.stdout))
    if args.profile:
        print(json.dumps(session.profile.summary(drop_first=COLD_FRAMES), indent=2))
    return np.concatenate(audio) if audio else np.zeros(0, dtype=np.float32)
