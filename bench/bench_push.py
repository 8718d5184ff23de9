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

Run: ``.venv/bin/python bench/bench_push.py [--pushes 5] [--skip-large]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

for _name, _value in {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

from tokcap.train import Trainer  # noqa: E402
from tokcap_core import LogprobParity, TrainingRow  # noqa: E402
from tokcap_vllm import WeightSync  # noqa: E402
from tokcap_vllm.weights import WeightPhase, WeightState  # noqa: E402

LARGE = {  # ~100M parameters with the tiny tokenizer's 2k vocabulary
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
PROMPTS, NEW_TOKENS = 8, 16
Transport = Literal["rpc", "shm"]
SKIP = ("config.json", "tokcap-tiny.json", "model.safetensors.index.json")


def build_large(tiny_dir: Path, out_dir: Path) -> Path:
    """A random Qwen3 with the ``LARGE`` shape and the tiny model's tokenizer, fp32, tied."""
    import transformers

    tiny = transformers.AutoConfig.from_pretrained(tiny_dir).to_dict()
    config = transformers.Qwen3Config(**{**tiny, **LARGE, "layer_types": None})
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
        ids = prompt + list(c.token_ids)
        lps = [0.0] * len(prompt) + [
            s[t].logprob for t, s in zip(c.token_ids, c.logprobs, strict=True)
        ]
        return TrainingRow(
            rollout_id=f"r{seed}-{i}",
            segment=0,
            input_ids=array("I", ids),
            loss_mask=array("B", [0] * len(prompt) + [1] * len(c.token_ids)),
            logprobs=array("f", lps),
            routes=None,
            prompt_len=len(prompt),
            call_spans=(),  # the trainer reads no span
            weight_version_min=version,
            weight_version_max=version,
            truncated=True,
            reward=None,
            sample_mask=1,
            reason=None,
            terminal_call_id="c",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    from tokcap.tiny import build_tiny_model

    tiny = build_tiny_model(Path(os.environ.get("TOKCAP_TINY_CACHE", "/tmp/tokcap-tiny")) / "dense")
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
