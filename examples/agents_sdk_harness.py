"""An OpenAI Agents SDK agent as the harness: tool calls through a gate, captured on one chain.

``python examples/agents_sdk_harness.py --ray-address HOST:PORT --gate URL [--gate URL ...]``
runs against gates someone started (``tokcap-vllm serve MODEL --tokcap-sink tq
--tokcap-ray-address HOST:PORT --tokcap-require-open --tokcap-return-token-ids
--enable-auto-tool-choice --tool-call-parser hermes``, their token in
``TOKCAP_CONTROL_TOKEN``). For each rollout it opens the rollout on a gate, then lets the
SDK's own ``Runner`` run an agent with a ``calc`` tool against the rollout's base URL, over
chat completions (``OpenAIChatCompletionsModel``) or the Responses API
(``OpenAIResponsesModel``), tracing off. The SDK sends every model call of the run to that
URL; the gate captures each one. The trainer's part is then `tokcap.compose`'s: close every
rollout with its reward, verify the receipts, reassemble the rows on the Ray pool, free them.

The agent makes exactly two tool calls, then answers. A trained model calls its tools by
itself; the tiny random model does not, so the first model call is forced: the agent asks
for ``tool_choice="required"``, and `ForcedChatModel` / `ForcedResponsesModel` turn that
into vLLM guided decoding of two Hermes ``<tool_call>`` blocks with the tool's schema
(`tokcap.demo.forced_tool_calls`; vLLM's ``hermes`` parser turns them into tool calls).
The SDK's ``reset_tool_choice`` (on by default) drops ``tool_choice`` once the agent has
used a tool, so the second call is the answer (guided to a number so that it ends; see
`forced` for that and for why the tool is not ``strict``).

Every HTTP answer the SDK receives passes an `EngineTap` on the way, which keeps the ids the
engine reported (``return_token_ids`` on chat, ``enable_response_messages`` on Responses)
for the check that each row equals the engine's ids. ``--report PATH`` writes what was
seen (SDK items, engine ids, receipts, rows) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import tokcap

tokcap.prepare_environment()  # before torch or Ray are imported

import anyio  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
from agents import (  # noqa: E402
    Agent,
    FunctionTool,
    Model,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    Tool,
    ToolCallItem,
    function_tool,
)
from agents.items import TResponseInputItem  # noqa: E402
from pydantic import Field  # noqa: E402

from tokcap.compose import (  # noqa: E402
    Batch,
    Finished,
    FleetEndpoint,
    GateEndpoint,
    open_stack,
    play_rollouts,
    served_model,
    services,
)
from tokcap.demo import forced_tool_calls  # noqa: E402
from tokcap_core import CaptureConfig  # noqa: E402
from tokcap_tq import TQSink, TQSinkConfig  # noqa: E402
from tokcap_vllm import GateFleet  # noqa: E402

API = Literal["chat", "responses"]
TOOL_CALLS = 2
"""Tool calls the first model call is forced to make (in parallel)."""
ANSWER_TOKENS, TOOL_TOKENS = 24, 256
ANSWER_PATTERN = "[0-9]{1,4}"
"""What the answer turn is guided to: a number, so that it ends by itself."""
INSTRUCTIONS = "You solve arithmetic with the calc tool, then answer with the number."


@function_tool(strict_mode=False)  # see `forced`
def calc(
    a: Annotated[int, Field(ge=0, le=99)],
    op: Literal["+", "-", "*"],
    b: Annotated[int, Field(ge=0, le=99)],
) -> str:
    """Compute ``a op b`` for integers a and b.

    Args:
        a: The left operand.
        op: The operator.
        b: The right operand.
    """
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b} = {value}"


def forced(settings: ModelSettings, tools: Sequence[Tool]) -> ModelSettings:
    """``settings`` for vLLM: ``tool_choice="required"`` becomes ``auto`` plus a structural
    tag forcing `TOOL_CALLS` Hermes tool calls on the agent's function tools; any other
    turn is the answer, guided to `ANSWER_PATTERN`.

    Why guide the answer: a random model's free text runs to ``max_tokens``, and the SDK's
    Responses model raises on the ``incomplete`` response that makes. Why the tool is not
    ``strict``: vLLM gives a tool the SDK marks ``strict`` its own tool-call grammar, which
    takes the place of the structural tag and leaves JSON whitespace unbounded.
    """
    body = dict(settings.extra_body or {}) if isinstance(settings.extra_body, dict) else {}
    if settings.tool_choice != "required":
        body["structured_outputs"] = {"regex": ANSWER_PATTERN}
        return settings.resolve(ModelSettings(max_tokens=ANSWER_TOKENS, extra_body=body))
    schemas = [
        {"function": {"name": t.name, "parameters": t.params_json_schema}}
        for t in tools
        if isinstance(t, FunctionTool)
    ]
    body.update(forced_tool_calls(schemas, TOOL_CALLS))
    force = ModelSettings(tool_choice="auto", max_tokens=TOOL_TOKENS, extra_body=body)
    return settings.resolve(force)


class ForcedSettings:
    """Mixed in before one of the SDK's models: its ``get_response`` runs on `forced`
    settings (the model's other methods are its own)."""

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        *args: Any,
        **kwargs: Any,
    ) -> ModelResponse:
        """The SDK's call, on the forced settings."""
        model = cast(Model, super())
        settings = forced(model_settings, tools)
        return await model.get_response(
            system_instructions, input, settings, tools, *args, **kwargs
        )


class ForcedChatModel(ForcedSettings, OpenAIChatCompletionsModel):
    """The SDK's chat-completions model, with ``tool_choice="required"`` forced as `forced`."""


class ForcedResponsesModel(ForcedSettings, OpenAIResponsesModel):
    """The SDK's Responses model, with ``tool_choice="required"`` forced as `forced`."""


@dataclass(slots=True)
class EngineCall:
    """One answer as the engine reported it over HTTP."""

    url: str
    response_id: str
    prompt_ids: list[int]
    output_ids: list[int]


class EngineTap:
    """An httpx response hook that keeps, per answered model call, the ids the engine
    reported: ``prompt_token_ids`` and ``token_ids`` of a chat completion, the
    ``input_messages`` / ``output_messages`` tokens of a Responses answer."""

    def __init__(self) -> None:
        self.calls: list[EngineCall] = []

    async def __call__(self, response: httpx.Response) -> None:
        """Record ``response`` if it is a model call's answer."""
        path = response.request.url.path
        if response.status_code != 200 or not path.endswith(("/chat/completions", "/responses")):
            return
        body = json.loads(await response.aread())
        if "choices" in body:
            prompt = body.get("prompt_token_ids") or []
            output = body["choices"][0].get("token_ids") or []
        else:
            prompt = [t for m in body.get("input_messages") or () for t in m["tokens"]]
            output = [t for m in body.get("output_messages") or () for t in m["tokens"]]
        self.calls.append(EngineCall(str(response.request.url), body["id"], prompt, output))

    def of(self, base_url: str) -> list[EngineCall]:
        """The calls made under ``base_url`` (one rollout's URL), in order."""
        return [c for c in self.calls if c.url.startswith(base_url.rstrip("/") + "/")]


@dataclass(slots=True)
class AgentRollout:
    """One agent run the harness plays; what the SDK and the engine said about it."""

    rollout_id: str
    group_id: str
    api: API
    task: tuple[int, str, int]
    base_url: str = ""
    tool_calls: list[str] = field(default_factory=list)
    """The arguments of every tool call the SDK's run result shows."""
    model_calls: int = 0
    """``len(result.raw_responses)``: the model calls the SDK made."""
    final_output: str = ""
    engine: list[EngineCall] = field(default_factory=list)
    finished: Finished | None = None


def score(task: tuple[int, str, int], answer: str) -> float:
    """1.0 when the last integer of the answer is the task's result (your scorer here)."""
    a, op, b = task
    numbers = re.findall(r"-?\d+", answer)
    return float(bool(numbers) and int(numbers[-1]) == {"+": a + b, "-": a - b, "*": a * b}[op])


async def play(
    tap: EngineTap, client: openai.AsyncOpenAI, model: str, rollout: AgentRollout, n: int
) -> None:
    """The harness: one agent run by the SDK's ``Runner`` at ``client``'s rollout URL."""
    rollout.base_url = str(client.base_url)
    extra = (
        {"return_token_ids": True} if rollout.api == "chat" else {"enable_response_messages": True}
    )
    engine: OpenAIChatCompletionsModel | OpenAIResponsesModel
    if rollout.api == "chat":
        engine = ForcedChatModel(model, openai_client=client)
    else:
        engine = ForcedResponsesModel(model, openai_client=client)
    agent = Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        tools=[calc],
        model=engine,
        model_settings=ModelSettings(temperature=1.0, tool_choice="required", extra_body=extra),
    )  # reset_tool_choice=True (the default): only the first call is forced
    a, op, b = rollout.task
    result = await Runner.run(
        agent,
        f"What is {a} {op} {b}?",
        max_turns=4,
        run_config=RunConfig(tracing_disabled=True, workflow_name=rollout.rollout_id),
    )
    rollout.tool_calls = [
        getattr(item.raw_item, "arguments", "") for item in result.new_items
        if isinstance(item, ToolCallItem)
    ]  # fmt: skip
    rollout.model_calls = len(result.raw_responses)
    rollout.final_output = str(result.final_output)
    rollout.engine = tap.of(rollout.base_url)
    reward = score(rollout.task, rollout.final_output)
    last = rollout.engine[-1].response_id if rollout.engine else None
    rollout.finished = Finished(rollout.rollout_id, rollout.group_id, reward, response_id=last)


def rollouts(apis: Sequence[API], per_api: int, run: str) -> list[AgentRollout]:
    """``per_api`` rollouts of one group per API, each on its own task (ids unique to
    ``run``: a rollout id names one rollout for as long as a gate holds it)."""
    return [
        AgentRollout(f"{run}-{api}-{i}", f"{run}-{api}", api, (3 + i, "+*"[i % 2], 4 + i))
        for api in apis
        for i in range(per_api)
    ]


def report(played: Sequence[AgentRollout], batch: Batch) -> dict[str, Any]:
    """What was seen, per rollout: the SDK's run, the engine's ids, the receipt and the row."""
    rows = {r.rollout_id: r for r in batch.rows}
    out: dict[str, Any] = {}
    for p in played:
        receipt = batch.receipts[p.rollout_id]
        row = rows.get(p.rollout_id)
        out[p.rollout_id] = {
            "api": p.api,
            "tool_calls": p.tool_calls,
            "model_calls": p.model_calls,
            "final_output": p.final_output,
            "engine": [asdict(c) for c in p.engine],
            "receipt": receipt.to_json(),
            "row": None
            if row is None
            else {
                "input_ids": list(row.input_ids),
                "loss_mask": list(row.loss_mask),
                "sample_mask": row.sample_mask,
                "call_ids": [s.call_id for s in row.call_spans],
            },
        }
    return out


def summary(played: Sequence[AgentRollout], batch: Batch) -> list[str]:
    """The lines the example prints: what the SDK did and what tokcap verified."""
    rows = {r.rollout_id: r for r in batch.rows if r.sample_mask}
    n = len(played)
    two = sum(len(p.tool_calls) == TOOL_CALLS for p in played)
    one_chain = sum(
        len(r.segments) >= 1 and len(r.segments[-1]) == len(p.engine)
        for p in played
        if (r := batch.receipts[p.rollout_id]).ok
    )
    equal = sum(
        p.rollout_id in rows
        and list(rows[p.rollout_id].input_ids)
        == [*p.engine[-1].prompt_ids, *p.engine[-1].output_ids]
        for p in played
        if p.engine
    )
    return [
        f"agents with {TOOL_CALLS} tool calls {two}/{n}",
        f"model calls {[p.model_calls for p in played]}",
        f"receipts verified {batch.receipts_verified}/{len(batch.receipts)}",
        f"terminal chain covers every call {one_chain}/{n}",
        f"rows equal to the engine's ids {equal}/{n}",
    ]


async def run(
    urls: Sequence[str], sink: TQSink, capture: CaptureConfig, args: argparse.Namespace
) -> int:
    """Open, play, collect, report, finish."""
    assert capture.control_token is not None
    played = rollouts(args.api, args.rollouts, f"agents-{secrets.token_hex(3)}")
    tap = EngineTap()
    async with GateFleet(urls, capture.control_token) as fleet:
        gates: GateEndpoint = FleetEndpoint(fleet, await served_model(urls[0]), urls)
        async with open_stack(
            [gates], sink=sink, capture=capture, workers=1, control=fleet
        ) as stack:
            for p in played:
                await fleet.open(p.rollout_id)
            async with openai.DefaultAsyncHttpxClient(event_hooks={"response": [tap]}) as http:
                await play_rollouts(
                    gates, played, lambda c, m, r, n: play(tap, c, m, r, n), concurrency=4,
                    http_client=http,
                )  # fmt: skip
            batch = await stack.collect([p.finished for p in played if p.finished is not None])
            for line in summary(played, batch):
                print(line)
            if args.report is not None:
                args.report.write_text(json.dumps(report(played, batch), indent=1))
            await stack.finish(batch)
    ok = batch.receipts_verified == len(played) and all(
        len(p.tool_calls) == TOOL_CALLS for p in played
    )
    return 0 if ok else 1


def main() -> int:
    """Parse the command line, join the cluster, run the agents, collect."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray-address", required=True, help="the cluster the gates stage into")
    parser.add_argument("--gate", action="append", required=True, help="a gate's URL (repeat)")
    parser.add_argument(
        "--api",
        action="append",
        choices=["chat", "responses"],
        help="the SDK model (repeat; default both)",
    )
    parser.add_argument("--rollouts", type=int, default=2, help="rollouts per API (one group)")
    parser.add_argument("--report", type=Path, help="write what was seen as JSON here")
    args = parser.parse_args()
    args.api = args.api or ["chat", "responses"]
    capture = CaptureConfig(
        segments="terminal", min_valid_fraction=0.5, control_token_env="TOKCAP_CONTROL_TOKEN"
    ).with_derived(environ=os.environ)
    sink = TQSink(TQSinkConfig())  # the partitions the gates stage into (their defaults)
    with services(None, workers=1, ray_address=args.ray_address):
        return anyio.run(run, args.gate, sink, capture, args)


if __name__ == "__main__":
    raise SystemExit(main())
