"""Exception types raised while loading a checkpoint."""


class VoiceChatConfigError(ValueError):
    """A checkpoint's ``config.json`` is inconsistent or describes something unsupported.

    The message names the offending field(s) and the expected value.
    """
