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

import contextlib
import functools
import hashlib
import shutil
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from ._cache import (
    STAMP,
    TINY_LAYERS,
    hash_recipe,
    library_versions,
    read_stamp,
    save_seeded_model,
    staging_dir,
    stamp_matches,
    write_stamp,
)

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "build_tiny_tokenizer",
]

RECIPE_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The tiny tokenizer's special tokens (ChatML): pad, turn start, turn end (eos)."""
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Plain ChatML without tools: the tiny tokenizer's own chat template."""
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
    recipe_hash = hash_recipe(recipe)
    if stamp_matches(out_dir, recipe_hash):
        return out_dir
    with staging_dir(out_dir) as tmp:
        tokenizer = _train_bpe(corpus, vocab_size)
        _save_tokenizer(tokenizer, tmp)
        _assert_same_ids(tokenizer, tmp)
        write_stamp(tmp, recipe, recipe_hash)
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
    recipe = {
        "what": "model",
        "version": RECIPE_VERSION,
        "kind": kind,
        "config": _config_args(kind),
        "tokenizer": _tokenizer_hash(tokenizer_dir),
        "seed": MODEL_SEED,
        "versions": library_versions(),
    }
    save = functools.partial(_save_random_model, kind)
    return build_beside_tokenizer(
        Path(out_dir), recipe, tokenizer_dir, save, prefix="tokcap-tiny-tok-"
    )


def build_beside_tokenizer(
    out_dir: Path,
    recipe: dict[str, Any],
    tokenizer_dir: Path | None,
    save: Callable[[Path, Path], None],
    *,
    prefix: str,
) -> Path:
    """Build (or reuse) ``out_dir`` from ``recipe``: ``save(tok_dir, folder)`` writes the model,
    then the tokenizer's files are copied next to it and checked to reload with the same ids.

    ``tokenizer_dir`` defaults to a tokenizer built by `build_tiny_tokenizer` in a temporary
    folder (named with ``prefix``).
    """
    recipe_hash = hash_recipe(recipe)
    if stamp_matches(out_dir, recipe_hash):
        return out_dir
    with tokenizer_or_built(tokenizer_dir, prefix) as tok_dir, staging_dir(out_dir) as tmp:
        save(tok_dir, tmp)
        for path in sorted(tok_dir.iterdir()):
            if path.is_file() and path.name != STAMP:
                shutil.copy2(path, tmp / path.name)
        _assert_same_ids(_load_trained(tok_dir), tmp)
        write_stamp(tmp, recipe, recipe_hash)
    return out_dir


@contextlib.contextmanager
def tokenizer_or_built(tokenizer_dir: Path | None, prefix: str) -> Iterator[Path]:
    """``tokenizer_dir``, or (None) a tokenizer built by `build_tiny_tokenizer` in a temporary
    folder named with ``prefix``, removed when the block ends."""
    if tokenizer_dir is not None:
        yield Path(tokenizer_dir)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        yield build_tiny_tokenizer(Path(scratch) / "tok")


def _tokenizer_hash(tokenizer_dir: Path | None) -> str:
    """The recipe hash of the tokenizer in ``tokenizer_dir`` (None: the default one's)."""
    if tokenizer_dir is None:
        return hash_recipe(_tokenizer_recipe(_corpus_files(), DEFAULT_VOCAB_SIZE))
    stamp = read_stamp(Path(tokenizer_dir))
    if stamp is None or stamp.get("recipe", {}).get("what") != "tokenizer":
        raise FileNotFoundError(f"{tokenizer_dir} is not a tokenizer built by build_tiny_tokenizer")
    return str(stamp["recipe_hash"])


def _save_random_model(kind: ModelKind, tok_dir: Path, out_dir: Path) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    args = _config_args(kind)
    args.update(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
    )
    config_class = transformers.Qwen3MoeConfig if kind == "moe" else transformers.Qwen3Config
    save_seeded_model(
        config_class(**args),
        out_dir,
        seed=MODEL_SEED,
        eos_token_id=args["eos_token_id"],
        pad_token_id=args["pad_token_id"],
    )


def _tokenizer_recipe(corpus: list[Path], vocab_size: int) -> dict[str, Any]:
    return {
        "what": "tokenizer",
        "version": RECIPE_VERSION,
        "vocab_size": vocab_size,
        "corpus": _corpus_digest(corpus),
        "template": CHATML_TEMPLATE,
        "split": QWEN2_SPLIT,
        "versions": library_versions(),
    }


def _config_args(kind: ModelKind) -> dict[str, Any]:
    """Architecture settings; vocabulary and special ids come from the tokenizer at build time."""
    args: dict[str, Any] = {
        **TINY_LAYERS,
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
