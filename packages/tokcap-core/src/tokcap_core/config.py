"""Configuration: `CaptureConfig`, and the validators every adapter's config class uses."""

from ._config import CaptureConfig, at_least, non_empty_text, one_of, positive_number

__all__ = ["CaptureConfig", "at_least", "non_empty_text", "one_of", "positive_number"]
