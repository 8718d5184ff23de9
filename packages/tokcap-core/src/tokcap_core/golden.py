"""Golden vectors: every digest pinned, recomputable (``tokcap-core golden``)."""

from ._golden import (
    GOLDEN_FORMAT,
    assert_golden_vectors,
    build_golden_vectors,
)

__all__ = [
    "GOLDEN_FORMAT",
    "assert_golden_vectors",
    "build_golden_vectors",
]
