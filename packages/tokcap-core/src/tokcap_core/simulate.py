"""Synthetic closed rollouts for tests and benchmarks.

Chains, forests, off-chain failures and every terminal rule, deterministic per seed.
"""

from ._simulate import (
    SimulatedRollout,
    simulate_rollout,
)

__all__ = [
    "SimulatedRollout",
    "simulate_rollout",
]
