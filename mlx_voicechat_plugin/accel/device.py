"""The one decision of where a model computes (the acceleration layer's only input).

MLX arrays carry no device: a model computes on MLX's default device when it is
evaluated, so the device of a loaded model is the default device at load time.
"""

from __future__ import annotations

import mlx.core as mx


def model_device() -> str:
    """``"cpu"`` when the model being loaded computes on the CPU (MLX's default device is the
    CPU: Linux ``mlx[cpu]``, or a Mac with ``mx.set_default_device(mx.cpu)``), else ``"gpu"``
    (Metal, CUDA)."""
    return "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"
