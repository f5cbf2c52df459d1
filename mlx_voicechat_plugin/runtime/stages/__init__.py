"""The stages of a streaming frame: per stage a per-session state object (``reset()``;
``state_arrays()`` where it holds MLX arrays) and one step over the rows of any number of sessions (:mod:`.mel`,
:mod:`.encoder` / :mod:`.encoder_rows`, :mod:`.transcript`, :mod:`.language`,
:mod:`.speech` / :mod:`.speech_sampling`, :mod:`.codec`; helpers :mod:`.rows` and
:mod:`.lanes`). :func:`mlx_voicechat_plugin.runtime.streaming.step.step_frames` runs them
all; ``docs/architecture.md`` tabulates the states.
"""
