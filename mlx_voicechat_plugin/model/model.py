"""``Model``: the upstream ``nemotron_voicechat`` model plus what the spec asks of a loader.

Differences from upstream ``mlx_vlm.models.nemotron_voicechat.Model`` (and why):

* the config is validated at construction (:func:`.validation.validate_config`), so an
  unsupported speaker, sample rate or inconsistent sub-config fails at load with one clear
  message instead of a shape error mid-turn;
* ``load_weights`` pins f32-only weights to f32 (:mod:`.pinning`), exact and faster on every
  frame; the memory cost is kept in :attr:`Model.pinning`;
* device-neutral, bit-identical speed-ups in plain MLX (each proven by tests against
  upstream): the codec's iSTFT normalisation cache is keyed on shapes and its
  non-overlapping upsampling and kernel-1 convolutions run as matmuls (:mod:`.codec`,
  :mod:`.convolutions`), the encoder's steady-state positional projection is memoised
  (:mod:`.encoder`), EAR-TTS caches its codebook tables (:mod:`.tts`) and norm offsets
  are computed once (:mod:`.norms`);
* after loading, the loader hands :meth:`Model.finish_loading` the optional acceleration
  layer's installer for the model's device (:mod:`mlx_voicechat_plugin.accel`: on the CPU,
  native kernels and two-core products; on a GPU nothing); this package never imports
  that layer;
* ``create_session`` returns :class:`~mlx_voicechat_plugin.runtime.offline.OfflineSession`
  (cached O(T) loop by default, input validation, progress), and the tokenizer is loaded
  from the checkpoint when the caller has none.

The module tree, parameter names and ``sanitize`` are upstream's, so checkpoints load
without renaming.
"""

from __future__ import annotations

from mlx_vlm.models.nemotron_voicechat.model import Model as UpstreamModel

from ..execution import DEFAULT, Execution
from .banded_attention import install_banded_attention
from .codec import ShapeKeyedISTFTCache, install_patch_upsampling
from .convolutions import install_pointwise_convolutions
from .derived import rebuild_derived
from .encoder import install_position_cache
from .norms import install_norms
from .pinning import PinningReport, pin_f32_weights, pinning_deferred, pinning_enabled
from .tts import FastRVQEARTTSModel
from .validation import validate_config


class Model(UpstreamModel):
    """NemotronLabs VoiceChat (``model_type: nemotron_voicechat``).

    Args:
        config: upstream ``ModelConfig``.

    Raises:
        VoiceChatConfigError: the config fails :func:`.validation.validate_config`.
    """

    def __init__(self, config):
        validate_config(config)
        super().__init__(config)
        # Same module tree and parameter names; faster, bit-identical computations.
        self.tts_model.tts_model = FastRVQEARTTSModel(config.tts_config)
        codec = self.tts_model.audio_codec
        codec._istft_cache = ShapeKeyedISTFTCache()
        install_patch_upsampling(codec.decoder)
        left_context = config.audio_config.encoder.att_context_size[0][0]
        self._position_caches = install_position_cache(self.stt_model.perception.encoder, left_context)
        install_banded_attention(self.stt_model.perception.encoder)  # offline memory linear in length
        install_pointwise_convolutions(self)
        self.pinning: PinningReport | None = None
        #: The installed acceleration layer (``"cpu"``) or None (:meth:`finish_loading`).
        self.acceleration: str | None = None
        self._tokenizer = None

    #: How the runtime schedules this model's concurrent work (:mod:`..execution`); the
    #: acceleration layer may replace it at load.
    execution: Execution = DEFAULT

    def load_weights(self, file_or_weights, strict: bool = True):
        """Load weights (upstream behaviour), then :meth:`finish_loading` (pinning unless
        ``MLX_VOICECHAT_PIN_F32=0``); inside :func:`.pinning.deferred_pinning` (the
        registration hook's ``load_model``) the loader calls it once its sources are freed.
        """
        result = super().load_weights(file_or_weights, strict=strict)
        if not pinning_deferred():
            self.finish_loading()
        return result

    def finish_loading(self, install_acceleration=None) -> None:
        """Pin f32-only weights tensor by tensor (:mod:`.pinning`), install the post-load
        speed-ups, then the acceleration layer when one is given; called once after the
        weights are in place.

        Args:
            install_acceleration: ``(model) -> name | None`` for the model's device; the
                loader hook passes ``mlx_voicechat_plugin.accel.install``; None installs
                nothing (the same numbers, slower on a CPU).
        """
        if pinning_enabled():
            self.pinning = pin_f32_weights(self)
        install_norms(self)
        # After loading: mlx-vlm quantizes (replacing Linear modules) before this call.
        if install_acceleration is not None:
            self.acceleration = install_acceleration(self) or self.acceleration
        self.clear_caches()

    def clear_caches(self) -> None:
        """Drop and rebuild everything derived from weights: codebook tables, memoised text
        conditions, the silent EAR-TTS prompt, positional projections, norm offsets, and the
        acceleration layer's weight copies (e.g. the CPU layer's f32 RNNT and subsampling
        products). Call it after changing parameters by hand (in place or
        by replacing them)."""
        self.tts_model.tts_model.clear_tables()
        self.__dict__.pop("_silent_prompts", None)
        for projection in self._position_caches:
            projection.clear_memo()
        rebuild_derived(self)

    @property
    def tokenizer(self):
        """The checkpoint's text tokenizer (loaded from ``model_path`` on first use)."""
        if self._tokenizer is None:
            path = getattr(self, "model_path", None)
            if path is None:
                raise RuntimeError(
                    "this model was not loaded from a checkpoint directory; pass a "
                    "tokenizer to create_session()"
                )
            from ..checkpoint import load_tokenizer

            self._tokenizer = load_tokenizer(path)
        return self._tokenizer

    def create_session(self, processor=None):
        """Return an :class:`~mlx_voicechat_plugin.runtime.offline.OfflineSession`.

        Args:
            processor: the processor or tokenizer returned by ``mlx_vlm.load``; when omitted,
                the checkpoint's tokenizer is loaded.
        """
        from ..runtime.offline import OfflineSession

        return OfflineSession(self, self._resolve_tokenizer(processor))

    def create_streaming_session(self, options=None, *, processor=None, prefill: bool = True, **fields):
        """Return a :class:`~mlx_voicechat_plugin.runtime.streaming.StreamingSession`.

        Args:
            options: a ``StreamingOptions``; or give its fields as keyword arguments
                (``system_prompt=``, ``seed=``, ``max_streaming_seconds=``,
                ``use_language_cache=``, ``use_perception_cache=``, ``profile=``).
            processor: the processor/tokenizer from ``mlx_vlm.load`` (default: the
                checkpoint's tokenizer).
            prefill: run the system prompt now (default); False leaves it to the caller
                (``session.prompt_ids``; the batched engine runs one token per tick).

        Raises:
            TypeError: both ``options`` and keyword fields given, or an unknown field.
            ValueError: an invalid option value (see ``StreamingOptions``).
        """
        from ..runtime.streaming import StreamingOptions, StreamingSession

        if options is not None and fields:
            raise TypeError("pass either a StreamingOptions or keyword fields, not both")
        if options is not None and not isinstance(options, StreamingOptions):
            raise TypeError(f"options must be a StreamingOptions, got {type(options).__name__}")
        if options is None:
            options = StreamingOptions(**fields)
        return StreamingSession(self, self._resolve_tokenizer(processor), options, prefill=prefill)

    def _resolve_tokenizer(self, processor):
        if processor is None:
            return self.tokenizer
        return getattr(processor, "tokenizer", processor)
