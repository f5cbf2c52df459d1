"""The realtime WebSocket server ``/v1/realtime`` (spec "Realtime WebSocket").

* :mod:`.settings` -- limits and policies (``ServerSettings``).
* :mod:`.protocol` -- client-message validation and server-event construction (no I/O).
* :mod:`.engine` -- the dedicated MLX engine thread and the single session slot.
* :mod:`.connection` -- one WebSocket connection's loop (timeouts, slicing, cancel).
* :mod:`.security` -- API key and Origin checks on the upgrade request.
* :mod:`.app` -- the FastAPI application (routes, health, 501 routes).
* :mod:`.cli` -- ``mlx-voicechat serve`` / ``python -m mlx_vlm.server --model <voicechat>``.
"""
