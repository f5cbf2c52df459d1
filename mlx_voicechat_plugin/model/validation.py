"""Load-time checks of a VoiceChat ``ModelConfig`` (spec "Limits", "Architecture")."""

from __future__ import annotations

from .errors import VoiceChatConfigError

SUPPORTED_SPEAKER = "Aria"
INPUT_SAMPLE_RATE = 16_000

#: Sizes that must be positive integers; a zero, negative, fractional or string value would
#: otherwise load and then fail inside MLX at the first frame (a sliding window of 0 even
#: aborted the process).
POSITIVE_SIZES = (
    "text_config.vocab_size", "text_config.hidden_size",
    "tts_config.hidden_size", "tts_config.num_hidden_layers", "tts_config.num_attention_heads",
    "tts_config.num_key_value_heads", "tts_config.head_dim", "tts_config.sliding_window",
    "tts_config.sliding_window_pattern",
    "audio_config.preprocessor.features", "audio_config.preprocessor.n_fft",
    "codec_config.n_fft", "codec_config.hop_length",
)


def validate_config(config) -> None:
    """Reject configurations the runtime cannot serve faithfully.

    Args:
        config: an upstream ``nemotron_voicechat`` ``ModelConfig``.

    Raises:
        VoiceChatConfigError: a speaker other than Aria; an input sample rate other than
            16 kHz (or a mel preprocessor at another rate); EAR-TTS and codec disagreeing on
            quantizer count, codebook size or latent width; a codec frame that is not one
            ``frame_duration`` of output audio; a character encoder narrower than EAR-TTS;
            an RNNT vocabulary that is not a list of strings or does not match the joint
            network; a size of :data:`POSITIVE_SIZES` that is not a positive integer.
    """
    problems: list[str] = []
    integer_fields = ("bos_token_id", "eos_token_id", "pad_token_id", "silence_token_id", "rnnt_blank_id",
                      "input_sample_rate", "output_sample_rate")
    for name in integer_fields:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name} must be an integer, got {value!r}")
    if isinstance(config.frame_duration, bool) or not isinstance(config.frame_duration, (int, float)) or not config.frame_duration > 0:
        problems.append(f"frame_duration must be a positive number, got {config.frame_duration!r}")
    for name in POSITIVE_SIZES:
        section, _, field = name.rpartition(".")
        owner = config
        for part in section.split("."):
            owner = getattr(owner, part, None)
        value = getattr(owner, field, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    vocabulary = config.rnnt_vocabulary
    if vocabulary is not None and (not isinstance(vocabulary, list) or not all(isinstance(p, str) for p in vocabulary)):
        problems.append("rnnt_vocabulary must be a list of strings (the RNNT's word pieces)")
    if problems:
        raise VoiceChatConfigError("unsupported nemotron_voicechat checkpoint: " + "; ".join(problems))
    vocab = config.text_config.vocab_size
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "silence_token_id"):
        value = getattr(config, name)
        if not 0 <= value < vocab:
            problems.append(f"{name} is {value}, outside the LLM vocabulary [0, {vocab})")
    if config.speaker != SUPPORTED_SPEAKER:
        problems.append(
            f"speaker is {config.speaker!r}; only the built-in {SUPPORTED_SPEAKER!r} voice "
            "is supported"
        )
    if config.input_sample_rate != INPUT_SAMPLE_RATE:
        problems.append(
            f"input_sample_rate is {config.input_sample_rate}; the model consumes "
            f"{INPUT_SAMPLE_RATE} Hz audio"
        )
    pre = config.audio_config.preprocessor
    if pre.sample_rate != config.input_sample_rate:
        problems.append(
            f"audio_config.preprocessor.sample_rate ({pre.sample_rate}) differs from "
            f"input_sample_rate ({config.input_sample_rate})"
        )
    tts, codec = config.tts_config, config.codec_config
    for tts_field, codec_field in (
        ("num_quantizers", "num_quantizers"),
        ("codebook_size", "codebook_size"),
        ("latent_size", "latent_dim"),
    ):
        tts_value, codec_value = getattr(tts, tts_field), getattr(codec, codec_field)
        if tts_value != codec_value:
            problems.append(
                f"tts_config.{tts_field} ({tts_value}) differs from "
                f"codec_config.{codec_field} ({codec_value})"
            )
    if codec.sample_rate != config.output_sample_rate:
        problems.append(
            f"codec_config.sample_rate ({codec.sample_rate}) differs from "
            f"output_sample_rate ({config.output_sample_rate})"
        )
    frame_samples = round(config.output_sample_rate * config.frame_duration)
    if codec.waveform_to_token_ratio != frame_samples:
        problems.append(
            f"one codec frame is {codec.waveform_to_token_ratio} samples but one "
            f"{config.frame_duration * 1000:g} ms frame at {config.output_sample_rate} Hz "
            f"is {frame_samples}"
        )
    input_frame = config.input_sample_rate * config.frame_duration
    encoder = config.audio_config.encoder
    mel_hop = pre.hop_length * encoder.subsampling_factor
    if round(input_frame) != mel_hop:
        problems.append(
            f"the encoder emits one frame per {mel_hop} samples but a "
            f"{config.frame_duration * 1000:g} ms input frame is {round(input_frame)} samples"
        )
    if tts.character_encoder.hidden_size != tts.hidden_size:
        problems.append(
            f"tts_config.character_encoder.hidden_size ({tts.character_encoder.hidden_size})"
            f" differs from tts_config.hidden_size ({tts.hidden_size})"
        )
    scale = tts.guidance_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        problems.append(  # upstream's sampler pairs cond / uncond rows only when it is > 0
            f"tts_config.guidance_scale must be a positive number, got {scale!r}"
        )
    vocabulary = config.rnnt_vocabulary
    classes = config.audio_config.joint.num_classes
    if vocabulary and len(vocabulary) != classes:
        problems.append(
            f"rnnt_vocabulary has {len(vocabulary)} pieces but the RNNT joint has "
            f"{classes} classes"
        )
    if config.rnnt_blank_id != classes:
        problems.append(
            f"rnnt_blank_id is {config.rnnt_blank_id}; the RNNT blank must be class {classes}"
        )
    if config.audio_config.output_dim != config.text_config.hidden_size:
        problems.append(
            f"audio_config.output_dim ({config.audio_config.output_dim}) differs from the "
            f"LLM hidden size ({config.text_config.hidden_size})"
        )
    if problems:
        raise VoiceChatConfigError(
            "unsupported nemotron_voicechat checkpoint: " + "; ".join(problems)
        )
