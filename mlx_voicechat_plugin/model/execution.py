"""How the runtime schedules a model's concurrent work: plain MLX on the model's device.

The runtime asks the loaded model for these contexts (:func:`execution_of`):

* :meth:`Execution.side` wraps work inside a streamed frame that does not depend on the
  main chain (the RNNT transcript);
* :meth:`Execution.worker` wraps an offline worker-thread job (the language model, the
  RNNT transcript), which already runs on its thread's own stream of the device the job was
  submitted from (:mod:`mlx_voicechat_plugin.runtime.workers`);
* :meth:`Execution.lanes` gives the contexts under which a batched stage's row groups are
  built (one lane by default; two CPU streams on a CPU model).

The default does nothing beyond MLX's defaults, so it is right on every device. An optional
acceleration layer (:mod:`mlx_voicechat_plugin.accel`) may give a model another policy at
load time by setting ``model.execution``; the runtime never imports that layer.
"""

from __future__ import annotations

import contextlib


class Execution:
    """The device-neutral policy: both contexts are no-ops."""

    #: Short name (reported by the bench and tests).
    name = "default"

    def side(self):
        """Context for independent work inside a frame (default: the caller's stream)."""
        return contextlib.nullcontext()

    def worker(self):
        """Context a worker-thread job enters around its work (default: none)."""
        return contextlib.nullcontext()

    def lanes(self, rows: int) -> list:
        """Fresh contexts, one per lane, under which a batched stage of ``rows`` independent
        rows builds its row groups (:mod:`mlx_voicechat_plugin.runtime.batch.lanes`;
        default: one lane, the caller's stream)."""
        return [contextlib.nullcontext()]


#: The policy of a model that no acceleration layer changed.
DEFAULT = Execution()


def execution_of(model) -> Execution:
    """``model.execution`` when set (a loaded :class:`~.model.Model`), else :data:`DEFAULT`."""
    execution = getattr(model, "execution", None)
    return execution if isinstance(execution, Execution) else DEFAULT
