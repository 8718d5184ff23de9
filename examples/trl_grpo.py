"""Train with Hugging Face TRL's ``GRPOTrainer`` through tokcap gates someone already started.

The gates are ``tokcap-vllm serve MODEL --tokcap-sink tq --tokcap-ray-address HOST:PORT
--tokcap-require-open --weight-transfer-config '{"backend": "tokcap_shm"}'`` (with
``VLLM_SERVER_DEV_MODE=1``), on this host, serving the checkpoint this script trains.
This process joins their Ray cluster and starts TransferQueue there (the gates stage every
call into it), then runs TRL's own trainer with `tokcap_trl.GRPORollouts` as its
``rollout_func``: each rollout is a two-turn chat played by `tokcap_trl.chat_harness`
through one gate, scored, closed, verified, and handed to TRL as the engine's exact ids;
after every optimizer step the weights go to every gate. It prints one JSON line per step.

    TOKCAP_CONTROL_TOKEN=... python examples/trl_grpo.py \\
        --ray-address HOST:PORT --gate URL --gate URL --model PATH

The task is a toy (the share of vowels in the answers); put your own prompts, harness and
score in its place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import anyio
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from tokcap_tq import TQSink, TQSinkConfig, connect_tq
from tokcap_trl import GRPORollouts, chat_harness, receipt_reward
from tokcap_vllm import wait_for_gates

PROMPTS = ["Write a word about cats.", "Write a word about rain.", "Write a word about tea."]


def score(answers: Sequence[str]) -> float:
    """The toy task's reward: the share of the answers' non-space characters that are vowels."""
    chars = [c for c in "".join(answers) if not c.isspace()]
    return sum(c in "aeiou" for c in chars) / len(chars) if chars else 0.0


class PrintSteps(TrainerCallback):
    """One JSON line per logged step: TRL's reward and tokcap's counts."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        """Print the step's reward, valid fraction and the gates' weight version."""
        if logs and "reward" in logs:
            keys = ("reward", "tokcap/valid_fraction", "tokcap/weight_version")
            print(json.dumps({"step": state.global_step, **{k: logs.get(k) for k in keys}}))


def train(args: argparse.Namespace, token: str) -> None:
    """Run ``args.steps`` GRPO steps through the gates."""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS * args.steps]
    )
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_vllm=False,  # the gates generate; TRL starts no engine
        use_cpu=args.cpu,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        per_device_train_batch_size=len(PROMPTS) * args.generations,
        num_generations=args.generations,
        beta=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    harness = chat_harness(score, turns=2, reply="More, please.", max_tokens=16)
    with GRPORollouts(
        args.gate, token=token, sink=TQSink(TQSinkConfig()), harness=harness
    ) as rollouts:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[receipt_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollouts,
            callbacks=[rollouts.callback, PrintSteps()],
        )
        trainer.train()
        versions = [info.version for info in rollouts.versions()]
        print(json.dumps({"steps": trainer.state.global_step, "gate_versions": versions}))


def main() -> None:
    """Parse the command line, join the gates' cluster, train."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--ray-address", required=True, help="the gates' Ray cluster")
    parser.add_argument("--gate", action="append", required=True, help="a gate's URL (repeat)")
    parser.add_argument("--model", required=True, help="the checkpoint the gates serve")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--output-dir", default="trl-grpo-out")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU")
    parser.add_argument(
        "--wait-s", type=float, default=600.0, help="for TransferQueue to start and the gates"
    )
    args = parser.parse_args()
    token = os.environ["TOKCAP_CONTROL_TOKEN"]
    deadline = time.monotonic() + args.wait_s
    with contextlib.ExitStack() as stack:
        # TransferQueue first: the gates wait for it before they serve.
        stack.enter_context(connect_tq(args.ray_address, init_timeout_s=args.wait_s))
        remaining = max(deadline - time.monotonic(), 60.0)
        anyio.run(lambda: wait_for_gates(args.gate, token, timeout_s=remaining))
        train(args, token)


if __name__ == "__main__":
    main()
