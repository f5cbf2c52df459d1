"""Demo checkpoints: random-weight NemotronLabs VoiceChat checkpoints in the real layout.

``python -m mlx_voicechat_plugin.demo build OUT --preset tiny|small|medium|real-layout|full
[--bits 4|8] [--seed N]`` builds one (``real-layout``: the published depths and dimensions at
tiny widths; ``full``: the published configuration at full size); :func:`default_checkpoint` builds (once, cached) the tiny preset
that commands use when no ``--model`` is given; :func:`sample_speech` is the bundled spoken
question (``mlx-voicechat demo speech`` prints its path).
"""

from .builder import build_checkpoint
from .cache import default_checkpoint
from .presets import PRESETS
from .sample import sample_speech

__all__ = ["PRESETS", "build_checkpoint", "default_checkpoint", "sample_speech"]
