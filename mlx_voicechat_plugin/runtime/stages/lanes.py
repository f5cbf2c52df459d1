"""Lanes: a batched stage's rows as two groups, each built on its own CPU stream.

On MLX's CPU backend one operation uses one core, and the CPU layer splits only large
products over the two cores (:mod:`mlx_voicechat_plugin.accel.cpu.parallel`): the norms,
elementwise operations, convolutions, the MoG sampling and most of the codec of a batched
tick run on one. Every row of a batched stage gets its solo bits whatever rows run beside
it (the engine's exactness tests), so a stage can as well run as two groups of rows, each
built under its own context from :meth:`~mlx_voicechat_plugin.execution.Execution.lanes`:
on a CPU model the first on the calling thread's default stream, the second on its
secondary stream, products whole in both; both are joined by the tick's one final
``mx.eval`` (no extra host round trip). On any other device, without the CPU layer, with
one core, with ``MLX_VOICECHAT_CPU_SPLIT=0``, with fewer than :data:`MIN_LANE_ROWS` rows,
or with ``MLX_VOICECHAT_BATCH_LANES=0``, a stage runs as one group as before.

:func:`~..streaming.step.step_frames` can run the encoder layers
(:func:`.encoder_rows.encode_frames`), EAR-TTS with its noise
(:func:`.speech_sampling.draw_noise_rows`, :func:`.speech.speech_step`) and the codec
(:func:`.codec.codec_decode`) in lanes, and the language model's and EAR-TTS's
per-session attention calls (``attention``); by default the codec and the attention do
(:data:`LANE_STAGES`). The language model's other work (large products, already split)
runs whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

from ...environment import OFF, ON, cut, shown
from ...execution import execution_of

#: Environment switch: ``0`` runs every batched stage as one group of rows, ``1`` (the
#: default) runs :data:`LANE_STAGES` in lanes, a comma-separated list of :data:`STAGES`
#: names runs those.
LANES_ENV = "MLX_VOICECHAT_BATCH_LANES"
#: Fewest rows (sessions) of a stage that run in two lanes.
MIN_LANE_ROWS = 2
#: The stages of the streaming step that can run in lanes (names passed to :func:`in_lanes`,
#: and ``attention``: the language model's and EAR-TTS's per-session attention calls,
#: shared between lanes by the policy's
#: :meth:`~mlx_voicechat_plugin.execution.Execution.attend_each`, :func:`in_lanes_wanted`).
STAGES = frozenset({"encoder", "speech", "codec", "attention"})
#: The stages run in lanes by default: the codec, whose rows are mostly activations (1,764
#: samples each), so two lanes cost about the CPU time of one, and the attention calls,
#: each of which reads only its own session's keys. EAR-TTS's and the encoder's products
#: are few rows against large weights, which each lane reads again (measured: about +25%
#: CPU time per 4-session tick with them, docs/performance.md).
LANE_STAGES = frozenset({"codec", "attention"})


def lane_stages() -> frozenset:
    """The stages to run in lanes, from ``MLX_VOICECHAT_BATCH_LANES`` (see :data:`LANES_ENV`).

    Raises:
        ValueError: the variable names a stage that is not one of :data:`STAGES`.
    """
    value = os.environ.get(LANES_ENV, "1").strip().lower()
    if value in OFF:
        return frozenset()
    if not value or value in ON:
        return LANE_STAGES
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    if not names:
        raise ValueError(f"{LANES_ENV}: {shown(value)} names no stage; use 0, 1 or some of {', '.join(sorted(STAGES))}")
    unknown = sorted(names - STAGES)
    if unknown:
        raise ValueError(
            f"{LANES_ENV}: unknown stage(s) {cut(', '.join(unknown))}; use 0, 1 or some of {', '.join(sorted(STAGES))}"
        )
    return names


def _running_stages() -> frozenset:
    """:func:`lane_stages` for a running tick: the engine checked the switch when it was made
    (:class:`~..batch.BatchedEngine`); a value made invalid since (by the embedding program)
    is logged once and the default stages run, so no tick fails its sessions for it."""
    try:
        return lane_stages()
    except ValueError as error:
        if str(error) not in _warned:
            _warned.add(str(error))
            _log.warning("%s (running with the default lanes: %s)", error, ", ".join(sorted(LANE_STAGES)) or "none")
        return LANE_STAGES


_log = logging.getLogger(__name__)
_warned: set[str] = set()


def in_lanes_wanted(stage: str) -> bool:
    """Whether ``MLX_VOICECHAT_BATCH_LANES`` lets ``stage`` run in lanes now (the policy
    still decides whether two lanes apply)."""
    return stage in _running_stages()


def plan(model, rows: int, stage: str | None = None) -> list[tuple[range, object]]:
    """How a batched stage of ``rows`` rows of ``model`` runs: per lane, its rows (consecutive,
    the first lane taking the larger half) and the context to build them under.

    Returns ``[(range(rows), context)]`` (one lane) unless ``rows >= MIN_LANE_ROWS``,
    ``stage`` is one of :func:`lane_stages` (None: any, when lanes are on) and the
    model's execution policy gives two lanes for them.

    Raises:
        ValueError: ``MLX_VOICECHAT_BATCH_LANES`` names an unknown stage.
    """
    stages = _running_stages() if rows >= MIN_LANE_ROWS else frozenset()
    wanted = bool(stages) and (stage is None or stage in stages)
    contexts = execution_of(model).lanes(rows) if wanted else None
    if not contexts or len(contexts) == 1 or rows < len(contexts):
        return [(range(rows), contexts[0] if contexts else contextlib.nullcontext())]
    count = len(contexts)
    bounds = [(rows * lane + count - 1) // count for lane in range(count)] + [rows]
    return [(range(start, stop), context) for start, stop, context in zip(bounds, bounds[1:], contexts)]


def in_lanes(model, rows: int, stage: Callable[[range], list], name: str | None = None) -> list:
    """``stage`` (called ``name``) over the rows ``0..rows-1`` in lanes (:func:`plan`): ``stage(part)`` returns
    one result per row of ``part`` (a ``range``), built under its lane's context; the
    results come back in row order, as ``stage(range(rows))`` alone would give them.

    Raises:
        ValueError: ``stage`` returned a different number of results than rows it was given.
    """
    results: list = []
    for part, context in plan(model, rows, name):
        with context:
            found = list(stage(part))
        if len(found) != len(part):
            raise ValueError(f"a lane stage returned {len(found)} results for {len(part)} rows")
        results += found
    return results


def evaluation_order(model, per_row: list[list]) -> list:
    """The arrays of a tick's final ``mx.eval``, ordered so that its lanes run side by side.

    MLX's ``eval`` orders the graph from the arrays it is given (a breadth-first walk of
    bounded width, ``MLX_BFS_MAX_WIDTH``, 20) and keeps only about 50 operations in flight on
    the streams (MLX 0.32: at most ``MAX_ACTIVE_TASKS = 10`` tasks, ``mlx/transforms.cpp``, of
    ``DISPATCHES_PER_TASK = 10`` dispatches each, ``backend/cpu/encoder.h``; an operation
    dispatches its kernel and the release of its inputs): given one lane's arrays first, it
    queues that lane's work first and the other lane's stream waits (measured: two stream
    threads runnable at once 9% of a 4-row codec decode). Taking the lanes' arrays in turn
    (one array of a row of the first lane, one of a row of the second, ...) lets both
    streams run (72%).

    Args:
        per_row: per row (session) the arrays to evaluate.

    Returns:
        The same arrays: in row order when the stages run as one lane (:func:`plan`),
        otherwise taken in turn from the lanes' rows.
    """
    parts = [part for part, _ in plan(model, len(per_row))]
    if len(parts) == 1:
        return [array for arrays in per_row for array in arrays]
    streams = [[array for row in part for array in per_row[row]] for part in parts]
    ordered = []
    for position in range(max(len(stream) for stream in streams)):
        ordered += [stream[position] for stream in streams if position < len(stream)]
    return ordered
