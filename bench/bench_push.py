"""Weight push into a running vLLM CPU engine: cost, and engine-vs-trainer parity around it.

For the demo's tiny model and for a ~100M-parameter random model of the same family
(Qwen3, fp32, tied embeddings, built in a temporary folder), one engine each (AsyncLLM,
engine core in its own process, ``WeightSyncWorker`` loaded). Per model:

* parity: sample rows with the engine, take one `tokcap.train.Trainer` step on them (its
  report: the pre-update recompute vs the engine, same weights), sample again and score
  the new rows with the stepped trainer before the push (stale) and after it (fresh);
* push cost: `WeightSync.push` of the full state dict over each transport (``rpc``: bytes
  through vLLM's RPC; ``shm``: one shared-memory file), median of a few pushes, split into
  check + stage (while the engine serves) and swap (paused: commit, version, prefix-cache
  reset, resume), as ms and MB/s;
* baselines measured in the same run: a plain in-memory copy of the same tensors
  (``clone``), and the file route (safetensors written to ``/dev/shm``, then vLLM's own
  ``reload_weights(weights_path=...)`` with the same pause/version/reset/resume).

Served gates (``--served``; the deployment shape): for the tiny model and
``tokcap.tiny.build_small_model``'s ~100M one, two ``tokcap-vllm serve`` processes (backend
``tokcap_shm``, ``VLLM_SERVER_DEV_MODE=1``); this process is the trainer. A push is
`GateWeightClient.push` (1 gate) or `FleetWeightSync.push` (2 gates; one shared-memory
file read by both), each client kept across pushes as a trainer keeps it (its connections,
the gate's spec and its push file reused), timed from the trainer's call until it returns:
vLLM's reload, the version label, the prefix-cache reset and the resume included, so the
engine serves the new version (checked: ``/weight_info`` reports it). Split into check +
stage (the finite-values check runs while the file is written) and swap (pause ...
resume). ``1 gate, http``: the same push with ``transport="http"`` (the bytes streamed in
the request body, what gates on other hosts take), here over loopback: a floor for a real
network, which adds the bytes' time on the wire. Against an in-memory ``clone`` of the
same state dict, same run. The first round is the trainer's first push (its push file and
the engine's reload buffers are new): printed on its own line, ``cold``, and left out of
the medians, which are the steady state a trainer pushing step after step sees. The swap
of the 1-gate push is split further by route (the time of each HTTP call, seen from the
trainer). Each gate's engine then says how it loaded its last push (its worker's
``tokcap_shm`` log line: the direct load with its copy/pack times, or vLLM's layerwise
reload and why).

Run: ``.venv/bin/python bench/bench_push.py [--pushes 5] [--skip-large] [--served]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, cast

for _name, _value in {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
from _harness import CPU_ENGINE_ARGS, stop_all  # noqa: E402  (bench/ is on sys.path)

from tokcap.tiny import SMALL_SHAPE  # noqa: E402
from tokcap.train import Trainer  # noqa: E402
from tokcap_core import LogprobParity, TrainingRow  # noqa: E402
from tokcap_core.simulate import one_call_row  # noqa: E402
from tokcap_vllm import WeightSync  # noqa: E402
from tokcap_vllm.weights import WeightPhase, WeightState  # noqa: E402

PROMPTS, NEW_TOKENS = 8, 16
Transport = Literal["rpc", "shm"]
SKIP = ("config.json", "tokcap-tiny.json", "model.safetensors.index.json")


def build_large(tiny_dir: Path, out_dir: Path) -> Path:
    """A random Qwen3 of `SMALL_SHAPE` (~100M) with the tiny model's tokenizer, fp32, tied."""
    import transformers

    tiny = transformers.AutoConfig.from_pretrained(tiny_dir).to_dict()
    config = transformers.Qwen3Config(**{**tiny, **SMALL_SHAPE, "layer_types": None})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    for path in tiny_dir.iterdir():
        if path.is_file() and path.suffix in (".json", ".jinja") and path.name not in SKIP:
            shutil.copy2(path, out_dir / path.name)
    return out_dir


@asynccontextmanager
async def engine_for(model_dir: Path) -> AsyncIterator[Any]:
    """An AsyncLLM (engine core in its own process) with the worker extension loaded."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=1024,
        worker_extension_cls="tokcap_vllm.WeightSyncWorker",
        disable_log_stats=True,
    )
    engine = AsyncLLM.from_engine_args(args)
    try:
        yield engine
    finally:
        engine.shutdown()


async def sample(engine: Any, version: int, seed: int) -> list[TrainingRow]:
    """``PROMPTS`` rows of ``NEW_TOKENS`` sampled tokens (T=1) with the engine's logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    async def one(i: int) -> TrainingRow:
        prompt = [(seed * 131 + i * 17 + k) % 2000 + 3 for k in range(24)]
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0, ignore_eos=True, seed=seed + i
        )
        final = None
        async for out in engine.generate(tokens_input(prompt), params, f"s{seed}-{i}"):
            final = out
        assert final is not None
        c = final.outputs[0]
        return one_call_row(
            f"r{seed}-{i}",
            prompt_ids=prompt,
            output_ids=c.token_ids,
            logprobs=[s[t].logprob for t, s in zip(c.token_ids, c.logprobs, strict=True)],
            weight_version=version,
            finish_reason="length",  # ignore_eos: every call runs to max_tokens
        )

    return list(await asyncio.gather(*(one(i) for i in range(PROMPTS))))


def score(trainer: Trainer, rows: list[TrainingRow]) -> LogprobParity:
    """Parity of ``rows`` against the trainer's current weights (no step)."""
    from tokcap.train import collate, token_logprobs
    from tokcap_core import logprob_parity

    with torch.no_grad():
        lp = token_logprobs(trainer.model, collate(rows))
    return logprob_parity(
        [r.logprobs for r in rows],
        [lp[i, : len(r.input_ids)].tolist() for i, r in enumerate(rows)],
        [r.loss_mask for r in rows],
    )


async def timed_push(
    sync: WeightSync, weights: dict[str, torch.Tensor], version: int, transport: Transport
) -> tuple[float, float]:
    """(check + stage seconds, swap seconds) of one push."""
    marks: dict[WeightPhase, float] = {}

    def mark(state: WeightState) -> None:
        marks[state.phase] = time.perf_counter()

    unsubscribe = sync.subscribe(mark)
    start = time.perf_counter()
    try:
        await sync.push(weights, version, transport=transport)
    finally:
        unsubscribe()
    return marks[WeightPhase.PUSHING] - start, marks[WeightPhase.READY] - marks[WeightPhase.PUSHING]


async def file_route(
    engine: Any, weights: dict[str, torch.Tensor], version: int, folder: Path
) -> float:
    """The baseline: safetensors in shared memory, then vLLM's own reload from that folder."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    save_file(
        {k: v.detach().clone().contiguous() for k, v in weights.items()},
        str(folder / "model.safetensors"),
    )
    await engine.pause_generation(mode="wait", clear_cache=False)
    await engine.collective_rpc(
        "reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True}
    )
    await engine.update_weight_version(str(version))
    await engine.reset_prefix_cache(reset_running_requests=True)
    await engine.resume_generation()
    return time.perf_counter() - start


def bench_model(name: str, model_dir: Path, pushes: int) -> dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"\n== {name}: {params / 1e6:.1f}M parameters; starting the engine ...", flush=True)

    async def run() -> dict[str, Any]:
        async with engine_for(model_dir) as engine:
            return await _bench(name, engine, model, params, pushes)

    return asyncio.run(run())


async def _bench(name: str, engine: Any, model: Any, params: int, pushes: int) -> dict[str, Any]:
    sync = await WeightSync.connect(engine)
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), version=sync.state.version
    )
    rows = await sample(engine, trainer.version, seed=1)
    same = trainer.step(rows, [1.0, -1.0] * (PROMPTS // 2)).parity
    stale_rows = await sample(engine, sync.state.version, seed=2)
    stale = score(trainer, stale_rows)
    weights = trainer.weights()
    megabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6

    stage_s: dict[Transport, list[float]] = {"rpc": [], "shm": []}
    swap_s: dict[Transport, list[float]] = {"rpc": [], "shm": []}
    for _ in range(pushes):
        for transport in ("rpc", "shm"):
            trainer.version += 1  # the same weights under a new version: cost only
            stage, swap = await timed_push(sync, weights, trainer.version, transport)
            stage_s[transport].append(stage)
            swap_s[transport].append(swap)
    fresh = score(trainer, await sample(engine, sync.state.version, seed=3))

    copy_s = []
    for _ in range(pushes):
        start = time.perf_counter()
        copies = {k: v.clone() for k, v in weights.items()}
        copy_s.append(time.perf_counter() - start)
        del copies
    file_s = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm:
        for _ in range(pushes):
            trainer.version += 1
            file_s.append(await file_route(engine, weights, trainer.version, Path(shm)))
    after_file = score(trainer, await sample(engine, trainer.version, seed=4))

    med = statistics.median
    push = {t: med([a + b for a, b in zip(stage_s[t], swap_s[t], strict=True)]) for t in stage_s}
    print(f"state dict {megabytes:.1f} MB ({len(weights)} tensors, tied lm_head included)")
    figures = [
        ("same weights (trainer's step report)", same),
        ("trainer stepped, engine not pushed", stale),
        ("after the push", fresh),
        ("after the file-route baseline", after_file),
    ]
    for label, figure in figures:
        print(f"parity  {label:38} K3 {figure.k3:.1e}  max|d| {figure.max_abs:.1e}")
    print(f"{'':28}{'median ms':>10}{'MB/s':>10}{'x push':>9}")
    rows_out = [
        ("push, transport rpc", push["rpc"]),
        ("  check + stage (serving)", med(stage_s["rpc"])),
        ("  swap (paused)", med(swap_s["rpc"])),
        ("push, transport shm", push["shm"]),
        ("  check + stage (serving)", med(stage_s["shm"])),
        ("  swap (paused)", med(swap_s["shm"])),
        ("baseline: file route", med(file_s)),
        ("baseline: in-memory clone", med(copy_s)),
    ]
    for label, seconds in rows_out:
        ratio = seconds / push["rpc"]
        print(f"{label:28}{seconds * 1e3:10.1f}{megabytes / seconds:10.0f}{ratio:9.2f}")
    return {
        "model": name,
        "params": params,
        "mb": megabytes,
        "push_ms": push["rpc"] * 1e3,
        "shm_ms": push["shm"] * 1e3,
        "file_ms": med(file_s) * 1e3,
    }


SERVE_ARGS = [
    *CPU_ENGINE_ARGS,
    "--max-model-len",
    "1024",
    "--no-enable-chunked-prefill",
    "--max-num-batched-tokens",
    "2048",
    "--weight-transfer-config",
    '{"backend": "tokcap_shm"}',
    "--tokcap-sink",
    "memory",
]


def start_gates(model_dir: Path, count: int, token: str, logs: Path) -> tuple[list[Any], list[str]]:
    """``count`` ``tokcap-vllm serve`` processes on loopback, ready; (processes, base URLs).
    Each logs at INFO (its engine's load lines) to ``logs/gate<i>.log``."""
    import socket
    import subprocess
    import sys

    import httpx

    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        TOKCAP_CONTROL_TOKEN=token,
        VLLM_LOGGING_LEVEL="INFO",
    )
    cli = str(Path(sys.executable).with_name("tokcap-vllm"))
    procs, urls = [], []
    for i in range(count):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [cli, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
        with (logs / f"gate{i}.log").open("wb") as log:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([*command, *SERVE_ARGS], env=env, stdout=log, stderr=log))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, url in zip(procs, urls, strict=True):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gate {url} exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
    return procs, urls


async def served_push(
    gate: Any, fleet: Any, urls: list[str], token: str, weights: Any, version: int
) -> list[float]:
    """One push to every gate in ``urls`` through the trainer's long-lived client (``gate``:
    a `GateWeightClient` for one gate; ``fleet``: a `FleetWeightSync` for several): [total,
    check + stage, swap] seconds (the check runs while the file is written; the fleet's
    steps run concurrently per gate, so only the total is split out for one gate)."""
    import httpx

    start = time.perf_counter()
    if gate.transport == "http":  # the bytes streamed in the request body, as across hosts
        await gate.push(weights, version)
        end = time.perf_counter()
        split = [float("nan")] * 2
    elif fleet is None:  # what `GateWeightClient.push` does, timed step by step
        await gate.check_version(version)
        staged = await gate.check_and_stage(weights)  # the finite check while writing the file
        staging = time.perf_counter()
        await gate.swap(staged, version)
        await gate.release()
        end = time.perf_counter()
        split = [staging - start, end - staging]
    else:
        await fleet.push(weights, version)
        end = time.perf_counter()
        split = [float("nan")] * 2
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {token}"}) as http:
        for url in urls:  # the engine serves the new version
            label = await http.get(url + "/weight_info")
            assert label.json()["weight_version"] == str(version), label.text
    return [end - start, *split]


class TimedTransport:
    """An httpx transport that records how long each request took, by path."""

    def __init__(self) -> None:
        import httpx

        self.inner = httpx.AsyncHTTPTransport()
        self.seconds: dict[str, list[float]] = {}
        self.recording = False

    async def handle_async_request(self, request: Any) -> Any:
        start = time.perf_counter()
        response = await self.inner.handle_async_request(request)  # its headers: work done
        if self.recording:
            self.seconds.setdefault(request.url.path, []).append(time.perf_counter() - start)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


async def served_runs(
    urls: list[str], token: str, weights: Any, pushes: int, routes: TimedTransport
) -> tuple[dict[str, list[list[float]]], list[float]]:
    """``pushes`` rounds of (1 gate, 2 gates, in-memory clone), clients kept across pushes
    as a trainer keeps them (their connections and the gate's spec reused); the first
    round's pushes come first in each list. ``routes`` times the 1-gate client's requests
    after the first round."""
    import httpx

    from tokcap_vllm.weights import FleetWeightSync, GateWeightClient

    figures: dict[str, list[list[float]]] = {"1 gate": [], "2 gates": [], "1 gate, http": []}
    copy_s = []
    version = 0
    async with (
        GateWeightClient(urls[0], token, http=cast(httpx.AsyncBaseTransport, routes)) as one,
        GateWeightClient(urls[0], token, transport="http") as streamed,
        FleetWeightSync([(url, token) for url in urls]) as fleet,
    ):
        await one.spec()
        await streamed.spec()
        for client in fleet.clients:
            await client.spec()
        rounds = (
            ("1 gate", one, urls[:1], None),
            ("2 gates", one, urls, fleet),
            ("1 gate, http", streamed, urls[:1], None),
        )
        for round_ in range(pushes):
            routes.recording = round_ > 0
            for label, client, gates, sync in rounds:
                version += 1  # above every gate's, whichever were pushed before
                push = await served_push(client, sync, gates, token, weights, version)
                figures[label].append(push)
                routes.recording = False  # the 1-gate client's own pushes only
            started = time.perf_counter()
            copies = {k: v.clone() for k, v in weights.items()}
            copy_s.append(time.perf_counter() - started)
            del copies
    return figures, copy_s


def bench_served(name: str, model_dir: Path, pushes: int) -> dict[str, Any]:
    """Push figures for 1 and 2 served gates of ``model_dir``, and the copy baseline."""
    import secrets

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    megabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    token = secrets.token_hex(16)
    print(f"\n== served {name}: {megabytes:.0f} MB; starting 2 gates ...", flush=True)
    pushes = max(2, pushes)  # the first is reported apart
    logs = Path(tempfile.mkdtemp(prefix="tokcap-bench-push-"))
    procs, urls = start_gates(model_dir, 2, token, logs)
    med = statistics.median
    routes = TimedTransport()
    try:
        load = os.getloadavg()
        figures, copy_s = asyncio.run(served_runs(urls, token, weights, pushes, routes))
        load = tuple(max(a, b) for a, b in zip(load, os.getloadavg(), strict=True))
    finally:
        stop_all(procs)
    for i in range(len(procs)):  # how each engine loaded: direct, or why not
        lines = (logs / f"gate{i}.log").read_text(errors="replace").splitlines()
        loads = [line.split("tokcap_shm", 1)[1] for line in lines if "tokcap_shm" in line]
        print(f"gate {i} engine, last push: tokcap_shm{loads[-1] if loads else ': (no line)'}")
    shutil.rmtree(logs, ignore_errors=True)
    copy = med(copy_s)
    print(f"load average (1, 5, 15 min; the higher of start and end): {load}")
    print(f"{'':30}{'median ms':>10}{'x copy':>9}")
    out: dict[str, Any] = {"model": name, "mb": megabytes, "copy_ms": copy * 1e3, "load": load}
    for label, (cold, *runs) in figures.items():
        total = med(r[0] for r in runs)
        out[label] = total * 1e3
        out[label + " cold"] = cold[0] * 1e3
        print(f"{'push, ' + label:30}{total * 1e3:10.1f}{total / copy:9.1f}")
        if label == "1 gate":
            for i, part in enumerate(("check + stage (shm file)", "swap (reload, resume)")):
                seconds = med(r[i + 1] for r in runs)
                print(f"{'  ' + part:30}{seconds * 1e3:10.1f}{seconds / copy:9.1f}")
            for path, times in routes.seconds.items():
                if path.startswith("/tokcap/v1/weights"):
                    continue  # check_version's and release's, not the swap's
                seconds = med(times)
                print(f"{'    ' + path:30}{seconds * 1e3:10.1f}{seconds / copy:9.1f}")
    print(f"{'baseline: in-memory clone':30}{copy * 1e3:10.1f}{1.0:9.1f}")
    colds = ", ".join(f"{label} {out[label + ' cold']:.1f}" for label in figures)
    print(f"first push (cold; not in the medians), ms: {colds}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--served", action="store_true", help="served gates only")
    args = parser.parse_args()
    from tokcap.tiny import build_tiny_model

    tiny = build_tiny_model(Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny")) / "dense")
    if args.served:
        from tokcap.tiny import build_small_model

        served = [bench_served("tiny", tiny, args.pushes)]
        if not args.skip_large:
            cache = Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny"))
            small = build_small_model(cache / "small")
            served.append(bench_served("~100M", small, max(3, args.pushes // 2 + 1)))
        print("\nsummary (served; shared memory on the same host, http as across hosts)")
        for r in served:
            print(
                f"  {r['model']:6} {r['mb']:7.1f} MB  1 gate {r['1 gate']:7.1f} ms, "
                f"2 gates {r['2 gates']:7.1f} ms, http {r['1 gate, http']:7.1f} ms, "
                f"copy {r['copy_ms']:6.1f} ms ({r['1 gate'] / r['copy_ms']:.1f}x / "
                f"{r['2 gates'] / r['copy_ms']:.1f}x / {r['1 gate, http'] / r['copy_ms']:.1f}x; "
                f"load {r['load'][0]:.1f})"
            )
        return
    results = [bench_model("tiny", tiny, args.pushes)]
    if not args.skip_large:
        with tempfile.TemporaryDirectory(prefix="tokcap-push-") as tmp:
            large = build_large(tiny, Path(tmp) / "large")
            results.append(bench_model("~100M", large, max(2, args.pushes // 2)))
    print("\nsummary")
    for r in results:
        size = f"{r['params'] / 1e6:7.1f}M params  {r['mb']:7.1f} MB"
        times = f"push rpc {r['push_ms']:7.1f} ms, shm {r['shm_ms']:7.1f} ms"
        print(f"  {r['model']:6} {size}  {times}, file route {r['file_ms']:7.1f} ms")


if __name__ == "__main__":
    main()
