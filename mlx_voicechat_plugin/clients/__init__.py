"""Clients for the realtime WebSocket ``/v1/realtime`` (spec "Realtime WebSocket", "Example").

* :mod:`.file` -- ``mlx-voicechat-file-client`` / ``python -m mlx_voicechat_plugin.clients.file``:
  drive an audio file through the socket and save the spoken answer;
* :mod:`.microphone` -- ``mlx-voicechat-mic`` / ``python -m mlx_voicechat_plugin.clients.microphone``:
  a live exchange through the microphone and speakers (needs the ``mic`` extra);
* the bundled browser page is served by the server itself at ``GET {prefix}/voicechat``.

Layers: :mod:`.protocol` (message building and event handling, no I/O), :mod:`.transport`
(the ``websockets`` connection and its failures), :mod:`.session` (configure, read to the
end), :mod:`.ringbuffer` and :mod:`.audio` (jitter buffer, capture / playback conversion),
:mod:`.devices` (the ``sounddevice`` boundary). Failures are :mod:`.errors` classes printed
as one line. See ``docs/clients.md``.
"""
