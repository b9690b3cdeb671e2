"""The one error of start-up configuration, apart from the API's errors (gateway/core/errors.py):
settings are read by processes that serve no HTTP (the Celery worker), which should not
import the web framework to learn of a bad setting."""


class ConfigError(ValueError):
    """A setting, engine knob or backend address that cannot be used, found at start:
    the message names what to change (the process exits 2 with it; never an HTTP answer)."""
