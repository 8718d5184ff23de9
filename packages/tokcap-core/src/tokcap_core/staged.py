"""Staged calls (the token payload a sink holds), their digests, their media items (images)
and their JSON form."""

from . import _media, _media_blob, _staged, _staged_json
from ._media import *  # noqa: F403
from ._media_blob import *  # noqa: F403
from ._staged import *  # noqa: F403
from ._staged_json import *  # noqa: F403

__all__ = [*_media.__all__, *_media_blob.__all__, *_staged.__all__, *_staged_json.__all__]
