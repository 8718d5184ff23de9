"""The walk: follow one rollout id from the HTTP request to a training row, module by module.

A real path, on an in-process gate over vLLM's CPU engine on the tiny model
(`tokcap.tiny`, started as ``tests/vllm/conftest.py`` starts it, its ledger file
included): the real ``openai`` client plays two turns of rollout ``R`` over HTTP; the
trainer closes it (`tokcap.compose.close_verified` over a `tokcap_vllm.ControlPlaneClient`:
one batch close over HTTP, the manifest in its answer, verified into a receipt); the
staged rows the receipt names are read from the gate's sink (`tokcap_core.rows.on_chain_keys`)
and reassembled into training rows (`tokcap_core.rows.reassemble_group`, what a pool actor
runs, here without Ray).

What is counted, precisely. ``sys.setprofile`` (Python 3.11 has no ``sys.monitoring``)
reports every Python frame as it starts, and again each time a coroutine or generator
resumes. A reported frame is *counted* when its code belongs to a tokcap module (the
``__name__`` of its globals is ``tokcap`` or starts with ``tokcap.`` or ``tokcap_``: every
package of the workspace), and its locals at that moment (a function starting: its
arguments; a frame resuming: its arguments and the locals bound so far, free variables
included) hold ``R``. Two ways of holding it are told apart, and each walk is measured both
ways from the same run:

- *the rollout id itself* (issue #32's "following ``rollout_id``"): a local that is the
  string ``R``, or a mapping with ``R`` among its keys, or a list, tuple, set or frozenset
  with ``R`` among its items (one level down, no further);
- *what holds it* (the call, the rollout's record, a close: following them too): besides
  those, an instance of a class defined in a tokcap module whose ``rollout_id`` attribute
  equals ``R``, itself or one level down in a mapping's keys or a collection's items.

A function going on after a call it made returned is not reported, so neither is it
counted. Frames the driver runs while it waits between turns (polling the ledger until the
turn's call is settled, so that each turn's commit lies inside its own walk) are not
counted. Threads: the driver's (the main thread: the openai client, the control-plane
client, the reassembly) and the gate's (the server's event-loop thread, and every thread
started once tracing began: the planning workers); threads vLLM started before (its
engine's) are not traced, and no rollout id reaches them.

(a) The tokcap modules the rollout id passes, end to end: every counted frame of both
    sides, distinct modules in order of first appearance.
(b) Inside the gate, per HTTP request (turn 1, turn 2, the close), from its ASGI entry
    (`tokcap_vllm.GateMiddleware`) to the next request: the counted frames the gate's
    threads run in the gate's own package (``tokcap_vllm``; the library it calls,
    ``tokcap_core``, is counted in (a) and reported on one line of its own) that *start*
    (a coroutine resuming after an await is control coming back to it, as a function
    going on after a call returned, which is not counted either; ``sys.monitoring``'s
    ``PY_START`` and not ``PY_RESUME``). A *stay* is a maximal run of consecutive such
    frames in one module; a *return* is a stay in a module that already had an earlier
    stay in the same request's walk.

    .venv/bin/python bench/walk_rollout.py [--json]
"""

from __future__ import annotations

import argparse
import dis
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROLLOUT_ID = "walk-r1"
PHASES = ("turn 1", "turn 2", "close")
"""The HTTP requests whose walks inside the gate are measured, in order."""
GATE_PACKAGE = "tokcap_vllm"


def tokcap_module(name: object) -> bool:
    """Whether a module name is one of the workspace's tokcap packages."""
    return isinstance(name, str) and (
        name == "tokcap" or name.startswith("tokcap.") or name.startswith("tokcap_")
    )


def _names(value: Any, rollout_id: str, holders: bool) -> bool:
    """Whether ``value`` itself names ``rollout_id``: is it, has it as a key, or (with
    ``holders``) is an instance of a tokcap class whose ``rollout_id`` is it."""
    if isinstance(value, str):
        return value == rollout_id
    if isinstance(value, Mapping):
        try:
            return rollout_id in value
        except Exception:  # a mapping that cannot answer: not counted
            return False
    if holders and tokcap_module(getattr(type(value), "__module__", None)):
        try:
            return bool(getattr(value, "rollout_id", None) == rollout_id)
        except Exception:
            return False
    return False


def _holds(values: Iterable[Any], rollout_id: str, holders: bool) -> bool:
    for value in values:
        if _names(value, rollout_id, holders):
            return True
        if isinstance(value, (list, tuple, set, frozenset)):
            try:
                if any(_names(item, rollout_id, holders) for item in value):
                    return True
            except Exception:  # a set another thread changed meanwhile: not counted
                pass
    return False


def holds_itself(values: Iterable[Any], rollout_id: str) -> bool:
    """Whether any of ``values`` (a frame's locals) is the rollout id itself, by the rules
    above: the string, a mapping keyed by it, a collection with it among its items."""
    return _holds(values, rollout_id, holders=False)


def holds(values: Iterable[Any], rollout_id: str) -> bool:
    """Whether any of ``values`` holds ``rollout_id``: itself, or in what holds it."""
    return _holds(values, rollout_id, holders=True)


_STARTS: dict[CodeType, int] = {}


def _start(code: CodeType) -> int:
    """Where a frame of ``code`` is when its start is reported (its first ``RESUME``)."""
    start = _STARTS.get(code)
    if start is None:
        start = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
        _STARTS[code] = start
    return start


@dataclass(frozen=True, slots=True)
class Step:
    """One counted frame."""

    module: str
    function: str
    gate: bool
    """Run by the gate's threads (not the driver's)."""
    resumed: bool = False
    """A coroutine or generator going on after an await or a yield (not a start)."""
    itself: bool = True
    """Its locals hold the rollout id itself (False: only what holds it)."""


class Tracer:
    """The profile function: a `Step` per counted frame, and the phases' marks."""

    def __init__(self, rollout_id: str) -> None:
        self.rollout_id = rollout_id
        self.driver = threading.get_ident()
        self.log: list[Step | str] = []
        self.on = False
        self.quiet = False
        """The driver is waiting: its own frames are not counted (the gate's still are)."""
        self._modules: dict[CodeType, str] = {}

    def mark(self, phase: str) -> None:
        """What follows belongs to ``phase``."""
        self.log.append(phase)

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        """The ``sys.setprofile`` function."""
        if event != "call" or not self.on:
            return
        code = frame.f_code
        module = self._modules.get(code)
        if module is None:
            name = frame.f_globals.get("__name__")
            module = self._modules[code] = (
                name if isinstance(name, str) and tokcap_module(name) else ""
            )
        if not module:
            return
        gate = threading.get_ident() != self.driver
        if not gate and self.quiet:
            return
        values = list(frame.f_locals.values())
        if holds(values, self.rollout_id):
            resumed = frame.f_lasti > _start(code)
            itself = holds_itself(values, self.rollout_id)
            self.log.append(Step(module, code.co_qualname, gate, resumed, itself))


@dataclass
class Walk:
    """The figures of one walk."""

    modules: list[str]
    """(a) the distinct tokcap modules the rollout id passes, in order of first appearance."""
    stays: dict[str, list[str]] = field(default_factory=dict)
    """(b) per request: the module of each stay inside the gate, in order."""
    functions: dict[str, list[list[str]]] = field(default_factory=dict)
    """(b) per request, per stay: the functions counted in it."""
    returns: dict[str, int] = field(default_factory=dict)
    """(b) per request: stays in a module that already had an earlier stay."""
    with_core: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per request: (stays, returns) when the gate's frames in every tokcap package count."""

    @property
    def max_returns(self) -> int:
        """The most returns of any request's walk inside the gate."""
        return max(self.returns.values(), default=0)


def stays_of(steps: Iterable[Step]) -> list[tuple[str, list[str]]]:
    """Maximal runs of consecutive steps in one module: ``(module, [function, ...])``."""
    out: list[tuple[str, list[str]]] = []
    for step in steps:
        if out and out[-1][0] == step.module:
            out[-1][1].append(step.function)
        else:
            out.append((step.module, [step.function]))
    return out


def returns_of(modules: Iterable[str]) -> int:
    """How many stays are in a module that already had an earlier stay."""
    seen: set[str] = set()
    count = 0
    for module in modules:
        count += module in seen
        seen.add(module)
    return count


@dataclass
class Walks:
    """One run's walk, measured both ways."""

    itself: Walk
    """Following the rollout id itself (issue #32's bars: at most 25 modules, 3 returns)."""
    held: Walk
    """Following what holds it too (its calls, its record, its close)."""


def figures(log: Iterable[Step | str], *, itself: bool = False) -> Walk:
    """The walk's figures from a tracer's log (phase marks and steps); ``itself``: only the
    frames that hold the rollout id itself."""
    modules: list[str] = []
    inside: dict[str, list[Step]] = {name: [] for name in PHASES}
    phase = ""
    for item in log:
        if isinstance(item, str):
            phase = item
            continue
        if itself and not item.itself:
            continue
        if item.module not in modules:
            modules.append(item.module)
        if item.gate and not item.resumed and phase in inside:
            inside[phase].append(item)
    walk = Walk(modules)
    for name, steps in inside.items():
        stays = stays_of(s for s in steps if s.module.split(".")[0] == GATE_PACKAGE)
        walk.stays[name] = [m for m, _ in stays]
        walk.functions[name] = [f for _, f in stays]
        walk.returns[name] = returns_of(walk.stays[name])
        every = [m for m, _ in stays_of(steps)]
        walk.with_core[name] = (len(every), returns_of(every))
    return walk


def walk(server: Any, control_token: str, rollout_id: str = ROLLOUT_ID) -> Walks:
    """Play the path on a started `tokcap_vllm.InProcessServer` and measure it.

    Its gate must accept ``control_token`` and return token ids, and must not know
    ``rollout_id`` yet.
    """
    import anyio
    import openai

    from tokcap.compose import close_verified
    from tokcap_core import CaptureConfig, ReassemblyRequest
    from tokcap_core.rows import on_chain_keys, reassemble_group
    from tokcap_vllm import ControlPlaneClient, RolloutClose

    tracer = Tracer(rollout_id)
    gate = server.gate

    async def install(profile: Callable[..., Any] | None) -> None:
        sys.setprofile(profile)  # on the server's event-loop thread

    async def nothing() -> None:
        pass

    def wait_settled(calls: int) -> None:
        """Block (not counted) until ``calls`` calls of the rollout are settled in its ledger,
        then let the server's loop run what that entry's step still had to do."""
        tracer.quiet = True
        try:
            ledger = gate.ledger(rollout_id)
            deadline = time.monotonic() + 120
            while sum(type(e.event).__name__ in ("Staged", "Failed") for e in ledger.entries) < (
                calls
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"call {calls} of {rollout_id} did not settle")
                time.sleep(0.01)
            for _ in range(3):
                server.call(nothing)
        finally:
            tracer.quiet = False

    async def turns() -> tuple[str, str]:
        messages: list[Any] = []
        answer: Any = None
        async with openai.AsyncOpenAI(
            base_url=server.rollout_url(rollout_id), api_key="x", max_retries=0
        ) as client:
            for turn, user in enumerate(("Count to three.", "And to four?"), start=1):
                if answer is not None:
                    messages.append(
                        {"role": "assistant", "content": answer.choices[0].message.content}
                    )
                messages.append({"role": "user", "content": user})
                tracer.mark(f"turn {turn}")
                answer = await client.chat.completions.create(
                    model=server.model, messages=messages, max_tokens=8, temperature=0.0
                )
                wait_settled(turn)  # blocks this loop: it has nothing else to do meanwhile
                tracer.mark("driver")
        return answer.id, answer.choices[0].message.content or ""

    async def trainer(response_id: str, content: str) -> Any:
        capture = CaptureConfig()
        closes = [
            RolloutClose(
                rollout_id=rollout_id, reward=1.0, response_id=response_id, content=content
            )
        ]
        async with ControlPlaneClient(server.base_url, control_token) as control:
            tracer.mark("close")
            receipts = await close_verified(control, closes, capture)
        tracer.mark("reassembly")
        receipt = receipts[rollout_id]
        request = ReassemblyRequest(
            group_id="walk-group",
            rollout_ids=(rollout_id,),
            receipts=(receipt,),
            rewards=(receipt.reward,),
            max_seq_len=capture.max_seq_len,
            clear_staging=False,
        )
        staged = {s.key: s for s in await gate.sink.get(on_chain_keys(request))}
        return reassemble_group(request, staged, staging_cleared=False)

    threading.setprofile(tracer.profile)  # threads started from now on (the planning workers)
    server.call(install, tracer.profile)
    sys.setprofile(tracer.profile)
    tracer.on = True
    try:
        response_id, content = anyio.run(turns)
        result = anyio.run(trainer, response_id, content)
    finally:
        tracer.on = False
        sys.setprofile(None)
        server.call(install, None)
        threading.setprofile(None)
    if result.finalized.valid_row_count < 1:
        raise RuntimeError(f"{rollout_id} reassembled into no valid training row: {result}")
    return Walks(figures(tracer.log, itself=True), figures(tracer.log))


def report(walks: Walks) -> str:
    """The walk, both ways, as a reader follows it."""
    lines: list[str] = []
    for title, w in (
        ("Following the rollout id itself", walks.itself),
        ("Following what holds it too (its calls, its record, its close)", walks.held),
    ):
        lines.append(f"{title}:")
        lines += ["    " + line for line in _report(w).splitlines()]
    return "\n".join(lines)


def _report(w: Walk) -> str:
    lines = [f"(a) {len(w.modules)} modules, HTTP request to training row:"]
    lines += [f"    {i:2d}. {m}" for i, m in enumerate(w.modules, start=1)]
    lines.append(f"(b) inside the gate ({GATE_PACKAGE}), from its ASGI entry, per HTTP request:")
    for phase in PHASES:
        stays = w.stays[phase]
        every, every_returns = w.with_core[phase]
        lines.append(
            f"    {phase}: {len(stays)} stays in {len(set(stays))} modules, "
            f"{w.returns[phase]} returns to a module already left "
            f"(every tokcap package: {every} stays, {every_returns} returns)"
        )
        for module, functions in zip(stays, w.functions[phase], strict=True):
            lines.append(f"        {module}: {' '.join(functions)}")
    return "\n".join(lines)


def main() -> None:
    """Start a gate on the tiny model, walk one rollout through it, print the figures."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # our tests/, not TQ's stray one
    from tests.engine_env import set_cpu_engine_env

    set_cpu_engine_env()
    from tests.vllm._helpers import VLLM_ARGS
    from tokcap.tiny import build_tiny_model
    from tokcap_core import CaptureConfig, MemorySink
    from tokcap_vllm import Gate, GateConfig, InProcessServer

    cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
    model = build_tiny_model(cache / "dense", kind="dense")
    token = "walk-token"
    with tempfile.TemporaryDirectory() as tmp:
        config = GateConfig(
            capture=CaptureConfig(control_token=token, return_token_ids=True),
            ledger_path=str(Path(tmp) / "ledger.jsonl"),
        )
        gate = Gate(config, sink=MemorySink())
        with InProcessServer(str(model), gate=gate, vllm_args=VLLM_ARGS) as server:
            result = walk(server, token)
    if options.json:
        out = {
            name: {**asdict(w), "max_returns": w.max_returns}
            for name, w in (("itself", result.itself), ("held", result.held))
        }
        print(json.dumps(out, indent=1))
    else:
        print(report(result))


if __name__ == "__main__":
    main()
