"""tokcap: token-exact capture from vLLM into TransferQueue, with receipts.

The rooms: `tokcap.compose` (a trainer's side and the stack it runs on), `tokcap.train`
(the torch trainer), `tokcap.tiny` (tiny models for tests and demos), `tokcap.demo` and
`tokcap.loop` (the ``tokcap demo`` and ``tokcap train`` commands). `prepare_environment`
is the start-up call of a process that runs the CPU engine in-process (before vLLM,
torch or Ray are imported); `use_driver_threads` gives that process's own torch (a
trainer) every core again once it has.
"""

from ._startup import (
    ENVIRONMENT_DEFAULTS,
    prepare_environment,
    quiet_third_parties,
    use_driver_threads,
)

__all__ = [
    "ENVIRONMENT_DEFAULTS",
    "prepare_environment",
    "quiet_third_parties",
    "use_driver_threads",
]
