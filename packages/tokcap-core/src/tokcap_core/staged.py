"""Staged calls (the token payload a sink holds), their digests and their JSON form."""

from . import _staged, _staged_json
from ._staged import *  # noqa: F403
from ._staged_json import *  # noqa: F403

__all__ = [*_staged.__all__, *_staged_json.__all__]
