"""Hold a two-node loopback Ray cluster for an e2e test, in its own process.

Run as ``python tests/e2e/_cluster.py TMP_DIR [--tq]``: prints the cluster's address on one
line, then keeps the cluster up until its stdin closes (the test process stays unconnected
to Ray, as a user's driver machine would be before ``tokcap train --ray-address``). With
``--tq`` it also runs TransferQueue on the cluster (`tokcap_tq.connect_tq`), so gates
started by hand and the trainers that come and go use one TransferQueue that outlives them.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from tokcap_tq import NodeSpec, connect_tq, local_cluster


@contextlib.contextmanager
def held_cluster(tmp: Path, env: Mapping[str, str], *, tq: bool = False) -> Iterator[str]:
    """Run this file in its own process (``--tq``: TransferQueue too); yield the address."""
    command = [sys.executable, __file__, str(tmp), *(["--tq"] if tq else [])]
    with subprocess.Popen(
        command, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout is not None
        assert holder.stdin is not None
        address = holder.stdout.readline().strip()
        assert address, f"the cluster did not start (exit {holder.poll()})"
        try:
            yield address
        finally:
            holder.stdin.close()  # the holder stops its cluster and exits
            holder.wait(timeout=120)


def main(tmp_dir: str, with_tq: bool) -> None:
    nodes = [NodeSpec(num_cpus=2), NodeSpec(num_cpus=2)]
    with (
        local_cluster(tmp_dir, nodes) as cluster,
        connect_tq(cluster.address) if with_tq else contextlib.nullcontext(),
    ):
        print(cluster.address, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], "--tq" in sys.argv[2:])
