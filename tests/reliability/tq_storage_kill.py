"""Kill TransferQueue's storage unit under a `TQSink` and report what ``get``/``put`` do.

Run as a script in its own process (a second Ray cannot start inside the test process):
prints a JSON line ``{"put": ..., "get_before": ..., "get_after": ..., "put_after": ...}``
where each outcome is ``"ok"``, ``"<ExceptionType>:<code>"`` or ``"hang (...)"`` (no answer
within ``--deadline-s``; with how long the cancelled call took to give up).

    .venv/bin/python tests/reliability/tq_storage_kill.py [--deadline-s 20] [--ops get,put,clear]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


async def _outcome(work, deadline_s: float) -> str:  # type: ignore[no-untyped-def]
    """``ok``, ``<Type>:<code>``, or ``hang`` (+ how long the cancelled call took to give up)."""
    start = time.monotonic()
    try:
        with anyio.fail_after(deadline_s):
            await work()
        return "ok"
    except TimeoutError:
        return f"hang ({time.monotonic() - start:.0f} s to return after cancel)"
    except Exception as e:  # reported, not raised: the test decides what is acceptable
        return f"{type(e).__name__}:{getattr(e, 'code', '-')}"


async def _main(deadline_s: float, ops: list[str]) -> dict[str, object]:
    import ray

    from tests.tq.support import fresh_tq_sink
    from tokcap_core.simulate import simulate_rollout

    sink = fresh_tq_sink(op_timeout_s=max(deadline_s / 2, 0.5))
    calls = [c for i in range(4) for c in simulate_rollout(f"kill{i}", seed=i, turns=2).calls]
    keys = [c.key for c in calls]
    result: dict[str, object] = {"keys": len(keys)}
    result["put"] = await _outcome(lambda: sink.put(calls), deadline_s)
    result["get_before"] = await _outcome(lambda: sink.get(keys), deadline_s)
    actors = ray.util.list_named_actors(all_namespaces=True)
    storage = [a for a in actors if "storage" in a["name"].lower()]
    result["named_actors"] = sorted(a["name"] for a in actors)
    for a in storage:
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
    result["killed"] = [a["name"] for a in storage]
    await anyio.sleep(1.0)
    more = simulate_rollout("kill-after", seed=99, turns=1).calls
    after = {
        "get": lambda: sink.get(keys),
        "put": lambda: sink.put(more),
        "clear": lambda: sink.clear(keys),
    }
    for op in ops:
        result[f"{op}_after"] = await _outcome(after[op], deadline_s)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deadline-s", type=float, default=20.0)
    parser.add_argument(
        "--ops",
        default="get,put",
        help="operations to try on the dead unit (the sink's own deadline is half of ours)",
    )
    args = parser.parse_args()
    from tokcap_tq import local_tq

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tqk", dir="/tmp") as tmp:
        with local_tq(Path(tmp)):
            result = anyio.run(_main, args.deadline_s, args.ops.split(","), backend="asyncio")
            result["run_s"] = round(time.monotonic() - started, 1)
            print(json.dumps(result), flush=True)
        result["shutdown_s"] = round(time.monotonic() - started - result["run_s"], 1)
        print(json.dumps(result), flush=True)
    # Threads still blocked on the dead unit's sockets would keep the interpreter from exiting.
    os._exit(0)


if __name__ == "__main__":
    main()
