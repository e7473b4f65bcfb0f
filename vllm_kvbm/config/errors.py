"""The one error every configuration check raises."""


class KVBMConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix."""
