"""Per-stage frame times over one long streamed session (how EAR-TTS
attention grows with the session's length); not part of the timed test suite.

Runs one :class:`~mlx_voicechat_plugin.runtime.streaming.StreamingSession` directly (no
server) with ``profile=True`` and prints, for every minute of audio, the median stage
times (perception, RNNT, language model, EAR-TTS, codec, total; ms), the median process
CPU time per frame and the load average, one JSON line per minute; ``--json PATH`` saves
the list. Profiling forces evaluation at stage boundaries, so the totals are not the
real-time factor; the point is which stage grows with the session's length (the language
model's and EAR-TTS's attention read KV caches one position longer every frame).

    python scripts/long_session_stages.py --preset medium --seconds 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

STAGES = ("perception", "rnnt", "language", "tts", "codec", "total")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium", help="demo checkpoint preset (default medium)")
    parser.add_argument("--model", help="checkpoint directory instead of a demo preset")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "mlx-voicechat-soak"))
    parser.add_argument("--seconds", type=float, default=600.0, help="seconds of audio (default 600)")
    parser.add_argument("--json", help="also write the per-minute rows here")
    args = parser.parse_args(argv)

    from mlx_voicechat_plugin.loading import load

    folder = Path(args.model) if args.model else Path(args.cache) / args.preset
    if not args.model and not (folder / "config.json").exists():
        from mlx_voicechat_plugin.demo import build_checkpoint

        print(f"building the {args.preset} demo checkpoint in {folder}", file=sys.stderr)
        build_checkpoint(folder, args.preset, seed=0)
    model, tokenizer = load(folder)
    session = model.create_streaming_session(
        processor=tokenizer, seed=0, max_streaming_seconds=args.seconds + 1, profile=True
    )
    frame = session.frame_samples
    frames = int(args.seconds * session.input_sample_rate) // frame
    per_minute = int(60 * session.input_sample_rate) // frame
    rng = np.random.default_rng(0)
    cpu, rows = [], []
    for index in range(frames):
        start = time.process_time()
        session.push_audio(rng.uniform(-0.3, 0.3, frame).astype(np.float32))
        cpu.append(time.process_time() - start)
        if (index + 1) % per_minute == 0 or index + 1 == frames:
            window = session.profile.frames[-per_minute:]
            row = {"audio_s": round((index + 1) * frame / session.input_sample_rate, 1)}
            for stage in STAGES:
                row[f"{stage}_ms"] = round(statistics.median(getattr(f, f"{stage}_ms") for f in window), 2)
            row["cpu_ms"] = round(1000 * statistics.median(cpu[-per_minute:]), 2)
            row["load_average"] = round(os.getloadavg()[0], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
