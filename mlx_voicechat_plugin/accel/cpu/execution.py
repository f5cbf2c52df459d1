"""The CPU layer's scheduling policy for the runtime (:mod:`mlx_voicechat_plugin.model.execution`).

* inside a streamed frame, the RNNT transcript runs on this thread's side CPU stream
  (:func:`.parallel.on_side_stream`), so it runs on the other core beside the language
  model, EAR-TTS and the codec;
* an offline worker job (the language model, the RNNT transcript) runs on its thread's side
  stream, from which products are not split: the worker threads and the calling thread
  already share the two cores.
"""

from __future__ import annotations

import mlx.core as mx

from ...model.execution import Execution
from .parallel import on_side_stream, side_stream


class CpuExecution(Execution):
    """Side work on a third CPU stream per thread (see the module docstring)."""

    name = "cpu"

    def side(self):
        return on_side_stream()

    def worker(self):
        return mx.stream(side_stream())
