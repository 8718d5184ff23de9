"""Tiny tokenizers and models built locally, for tests, the demo and benchmarks (no hub).

The tokenizer is a byte-level BPE trained on Python's own stdlib sources with the
Qwen2 pre-tokenizer rule, so a folder that transformers reloads through
``Qwen2Tokenizer`` (which rebuilds its own pre-tokenizer and ignores the one in
``tokenizer.json``) still yields identical ids; every build asserts that. Models are
transformers configs with seeded random fp32 weights (hidden 64, 2 layers, head_dim 32).

Builds are deterministic and cached: a finished folder holds a ``tokcap-tiny.json``
stamp with the hash of its recipe, and a later call with the same recipe returns at once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHATML_TEMPLATE",
    "CHATML_TOOLS_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "build_tiny_tokenizer",
]

STAMP = "tokcap-tiny.json"
RECIPE_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5-style ChatML with tools: the tool list in the system turn, each call as one
# ``<tool_call>`` JSON object (arguments re-serialised with ``tojson``), consecutive tool
# results grouped in one user turn as ``<tool_response>`` blocks. Requests pass it as
# ``chat_template`` (the tokenizer keeps `CHATML_TEMPLATE`).
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and not message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The rule Qwen2Tokenizer hard-codes; training with it keeps ids stable across reloads.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS_FILES = 160
DEFAULT_VOCAB_SIZE = 2048
MODEL_SEED = 0
CORPUS_FILE_BYTES = 64_000
PROBES = (
    "def f(x):\n    return x + 1  # 1 12 123 1234\n",
    "Hello, world! It's 2026; don't   panic.\r\n\ttabs\n\n",
    '{"name": "search", "arguments": {"query": "false", "k": 10}}',
    "<|im_start|>user\nWhat's 17 * 23?<|im_end|>\n<|im_start|>assistant\n391<|im_end|>\n",
    "naïve café — Ωmega 漢字 🙂",
)
ModelKind = Literal["dense", "moe"]


def build_tiny_tokenizer(out_dir: Path, *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train (or reuse) a byte-level BPE tokenizer with ChatML specials in ``out_dir``.

    ``<|im_end|>`` is the eos token, ``<|endoftext|>`` the pad token. The saved folder
    loads with ``transformers.AutoTokenizer.from_pretrained(out_dir)`` and gives the
    same ids as the trained ``tokenizers`` object (asserted before the stamp is written).
    """
    out_dir = Path(out_dir)
    corpus = _corpus_files()
    recipe = _tokenizer_recipe(corpus, vocab_size)
    recipe_hash = _hash(recipe)
    if _stamp_matches(out_dir, recipe_hash):
        return out_dir
    with _staging_dir(out_dir) as tmp:
        tokenizer = _train_bpe(corpus, vocab_size)
        _save_tokenizer(tokenizer, tmp)
        _assert_same_ids(tokenizer, tmp)
        _write_stamp(tmp, recipe, recipe_hash)
    return out_dir


def build_tiny_model(
    out_dir: Path, *, kind: ModelKind = "dense", tokenizer_dir: Path | None = None
) -> Path:
    """Build (or reuse) a tiny random-weight causal LM in ``out_dir``, tokenizer files included.

    ``kind="dense"`` is a Qwen3 model, ``kind="moe"`` a Qwen3-MoE with 4 experts, top-2.
    Weights are fp32 and seeded, so two builds are byte-identical. ``tokenizer_dir``
    defaults to a tokenizer built by `build_tiny_tokenizer` in a temporary folder.
    """
    if kind not in ("dense", "moe"):
        raise ValueError(f"kind must be 'dense' or 'moe', not {kind!r}")
    out_dir = Path(out_dir)
    if tokenizer_dir is None:
        tok_hash = _hash(_tokenizer_recipe(_corpus_files(), DEFAULT_VOCAB_SIZE))
    else:
        tok_stamp = _read_stamp(Path(tokenizer_dir))
        if tok_stamp is None or tok_stamp.get("recipe", {}).get("what") != "tokenizer":
            raise FileNotFoundError(
                f"{tokenizer_dir} is not a tokenizer built by build_tiny_tokenizer"
            )
        tok_hash = tok_stamp["recipe_hash"]
    recipe = {
        "what": "model",
        "version": RECIPE_VERSION,
        "kind": kind,
        "config": _config_args(kind),
        "tokenizer": tok_hash,
        "seed": MODEL_SEED,
        "versions": _library_versions(),
    }
    recipe_hash = _hash(recipe)
    if _stamp_matches(out_dir, recipe_hash):
        return out_dir
    with tempfile.TemporaryDirectory(prefix="tokcap-tiny-tok-") as scratch:
        tok_dir = (
            Path(tokenizer_dir)
            if tokenizer_dir is not None
            else build_tiny_tokenizer(Path(scratch) / "tok")
        )
        with _staging_dir(out_dir) as tmp:
            _save_random_model(kind, tok_dir, tmp)
            for path in sorted(tok_dir.iterdir()):
                if path.is_file() and path.name != STAMP:
                    shutil.copy2(path, tmp / path.name)
            _assert_same_ids(_load_trained(tok_dir), tmp)
            _write_stamp(tmp, recipe, recipe_hash)
    return out_dir


def _save_random_model(kind: ModelKind, tok_dir: Path, out_dir: Path) -> None:
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    args = _config_args(kind)
    args.update(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
    )
    config_class = transformers.Qwen3MoeConfig if kind == "moe" else transformers.Qwen3Config
    config = config_class(**args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=args["eos_token_id"], pad_token_id=args["pad_token_id"]
    )
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _tokenizer_recipe(corpus: list[Path], vocab_size: int) -> dict[str, Any]:
    return {
        "what": "tokenizer",
        "version": RECIPE_VERSION,
        "vocab_size": vocab_size,
        "corpus": _corpus_digest(corpus),
        "template": CHATML_TEMPLATE,
        "split": QWEN2_SPLIT,
        "versions": _library_versions(),
    }


def _library_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("tokenizers", "transformers", "torch")}


def _config_args(kind: ModelKind) -> dict[str, Any]:
    """Architecture settings; vocabulary and special ids come from the tokenizer at build time."""
    args: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    if kind == "moe":
        args.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1
        )
    return args


def _corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))[:CORPUS_FILES]


def _corpus_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for text in _corpus_texts(files):
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()


def _corpus_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_bytes()[:CORPUS_FILE_BYTES].decode("utf-8", errors="replace")


def _train_bpe(files: list[Path], vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_texts(files), trainer=trainer)
    return tokenizer


def _save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        chat_template=CHATML_TEMPLATE,
        model_max_length=32768,
    )
    fast.save_pretrained(out_dir)


def _load_trained(tok_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def _assert_same_ids(tokenizer: Any, folder: Path) -> None:
    """Fail the build unless ``AutoTokenizer`` on ``folder`` gives the trained ids."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(folder)
    for text in PROBES:
        trained = tokenizer.encode(text, add_special_tokens=False).ids
        loaded = reloaded.encode(text, add_special_tokens=False)
        if trained != loaded:
            raise RuntimeError(
                f"{folder}: {type(reloaded).__name__} re-tokenises {text!r} differently "
                f"({trained[:12]} vs {loaded[:12]})"
            )
    if reloaded.eos_token != EOS_TOKEN or reloaded.chat_template is None:
        raise RuntimeError(f"{folder}: eos token or chat template lost on reload")


def _hash(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        stamp: dict[str, Any] = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp


def _stamp_matches(folder: Path, recipe_hash: str) -> bool:
    stamp = _read_stamp(folder)
    if stamp is None or stamp.get("recipe_hash") != recipe_hash:
        return False
    return all((folder / name).is_file() for name in stamp.get("files", ()))


def _write_stamp(folder: Path, recipe: dict[str, Any], recipe_hash: str) -> None:
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    stamp = {
        "recipe_hash": recipe_hash,
        "recipe": recipe,
        "files": files,
        "python": sys.version.split()[0],
    }
    (folder / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


class _staging_dir:
    """Build in a sibling temporary folder, then move it onto ``out_dir`` (never half-written).

    An existing ``out_dir`` is replaced only if it is empty or holds a stale tokcap stamp.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        if (
            self.out_dir.exists()
            and any(self.out_dir.iterdir())
            and _read_stamp(self.out_dir) is None
        ):
            raise FileExistsError(
                f"{self.out_dir} exists and is not a tokcap tiny build; refusing to replace it"
            )
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}-", dir=self.out_dir.parent))
        return self.tmp

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        self.tmp.chmod(0o755)  # mkdtemp makes it private; engines may run as another user
        self.tmp.rename(self.out_dir)
