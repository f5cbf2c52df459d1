"""The CPU layer's scheduling policy for the runtime (:mod:`mlx_voicechat_plugin.execution`).

* inside a streamed frame, the RNNT transcript runs on this thread's side CPU stream
  (:func:`.parallel.on_side_stream`), so it runs on the other core beside the language
  model, EAR-TTS and the codec;
* an offline worker job (the language model, the RNNT transcript) runs on its thread's side
  stream, from which products are not split: the worker threads and the calling thread
  already share the two cores;
* a batched stage's two row groups ("lanes", :mod:`mlx_voicechat_plugin.runtime.stages.lanes`)
  are built one on the calling thread's default stream, one on its secondary stream
  (:func:`.parallel.secondary_stream`), their products left whole (each lane has a core);
* attention runs the CPU backend's own computation with native products
  (:func:`.attention.exact_attention`), long keys on both cores; a batched step's
  per-session attention calls are shared between the two streams
  (:func:`.attention.session_lanes`).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from ...execution import Execution
from .attention import exact_attention, session_lanes
from .parallel import on_side_stream, secondary_stream, side_stream, split_enabled, unsplit


class CpuExecution(Execution):
    """Side work on a third CPU stream per thread, lanes on two (see the module docstring)."""

    name = "cpu"

    def side(self):
        return on_side_stream()

    def worker(self):
        return mx.stream(side_stream())

    def attention(self, queries, keys, values, cache, scale: float, mask=None) -> mx.array:
        """:func:`.attention.exact_attention` (the same bits as the default, faster)."""
        return exact_attention(queries, keys, values, cache, scale=scale, mask=mask)

    def attend_each(self, calls: list, works: list[int]) -> list:
        """The calls shared between this thread's default and secondary CPU streams, each
        whole on its lane, when :func:`.attention.session_lanes` says so; otherwise in
        order (each long call splitting itself). Same outputs either way."""
        lanes = session_lanes(works)
        if lanes is None:
            return super().attend_each(calls, works)
        secondary = secondary_stream()
        outputs = []
        for call, lane in zip(calls, lanes):
            with _on_stream_unsplit(secondary) if lane else unsplit():
                outputs.append(call())
        return outputs

    def lanes(self, rows: int) -> list:
        """Two lanes (default stream, secondary stream; products unsplit in both) when the
        default device is the CPU, the machine has two cores, splitting is on
        (:func:`.parallel.split_enabled`) and ``rows >= 2``; otherwise one lane."""
        if rows < 2 or mx.default_device() != mx.cpu or not split_enabled():
            return super().lanes(rows)
        return [unsplit(), _on_stream_unsplit(secondary_stream())]


@contextlib.contextmanager
def _on_stream_unsplit(stream):
    with mx.stream(stream), unsplit():
        yield
