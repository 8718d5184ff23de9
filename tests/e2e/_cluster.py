"""Hold a two-node loopback Ray cluster for an e2e test, in its own process.

Run as ``python tests/e2e/_cluster.py TMP_DIR``: prints the cluster's address on one line,
then keeps the cluster up until its stdin closes (the test process stays unconnected to
Ray, as a user's driver machine would be before ``tokcap train --ray-address``).
"""

from __future__ import annotations

import sys

from tokcap_tq import NodeSpec, local_cluster


def main(tmp_dir: str) -> None:
    nodes = [NodeSpec(num_cpus=2), NodeSpec(num_cpus=2)]
    with local_cluster(tmp_dir, nodes) as cluster:
        print(cluster.address, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1])
