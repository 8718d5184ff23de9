"""Peers' capture formats, stdlib only: read, verify against the peer's own rules, convert.

`tokcap_core.interop.gym` covers NeMo-Gym's token-id capture (staged records, receipts,
manifests, lineage files, digests, verifier; export of tokcap captures). Each format is
checked against the peer's own published vectors.
"""

from . import gym

__all__ = ["gym"]
