"""Tiny local tokenizer and models: ids survive a reload; builds are cached and deterministic."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tokcap.tiny import SPECIAL_TOKENS, build_tiny_model, build_tiny_tokenizer

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TEXTS = (
    "x = 1 + 12  # 123\n",
    "It's true: false != False, isn't it?\n\n\tindent",
    '{"tool": "grep", "args": {"pattern": "def ", "max": 3}}',
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_dir: Path) -> Path:
    return build_tiny_tokenizer(tiny_dir / "tokenizer")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tokenizer_reloads_with_identical_ids(tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer

    trained = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    reloaded = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for text in TEXTS:
        assert reloaded.encode(text, add_special_tokens=False) == trained.encode(text).ids


def test_tokenizer_survives_the_qwen2_reload_trap(tokenizer_dir: Path) -> None:
    """Qwen2Tokenizer rebuilds its own pre-tokenizer; the trained split rule is the same one."""
    from tokenizers import Tokenizer

    trained = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    qwen2 = transformers.Qwen2Tokenizer.from_pretrained(tokenizer_dir)
    for text in TEXTS:
        assert qwen2.encode(text, add_special_tokens=False) == trained.encode(text).ids


def test_tokenizer_has_chatml_specials_and_template(tokenizer_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert len(tok) == 2048
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 2
    assert ids.count(2) == 1


def test_tokenizer_build_is_cached(tokenizer_dir: Path) -> None:
    stamp = tokenizer_dir / "tokcap-tiny.json"
    before = stamp.stat().st_mtime_ns
    assert build_tiny_tokenizer(tokenizer_dir) == tokenizer_dir
    assert stamp.stat().st_mtime_ns == before


def test_tokenizer_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_tokenizer(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_model_loads_and_generates(kind: Any, tiny_dir: Path, tokenizer_dir: Path) -> None:
    model_dir = build_tiny_model(tiny_dir / kind, kind=kind, tokenizer_dir=tokenizer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert model.dtype == torch.float32
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 32)
    if kind == "moe":
        assert config.model_type == "qwen3_moe"
        assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4)
    assert model.generation_config.eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_model_build_is_deterministic_and_cached(
    kind: Any, tiny_dir: Path, tokenizer_dir: Path
) -> None:
    first = build_tiny_model(tiny_dir / f"{kind}-a", kind=kind, tokenizer_dir=tokenizer_dir)
    second = build_tiny_model(tiny_dir / f"{kind}-b", kind=kind, tokenizer_dir=tokenizer_dir)
    assert _digests(first) == _digests(second)
    before = (first / "tokcap-tiny.json").stat().st_mtime_ns
    build_tiny_model(first, kind=kind, tokenizer_dir=tokenizer_dir)
    assert (first / "tokcap-tiny.json").stat().st_mtime_ns == before


def test_model_folder_tokenizes_like_its_tokenizer(tiny_dir: Path, tokenizer_dir: Path) -> None:
    """A qwen3 model folder must not re-tokenise differently from its own tokenizer."""
    model_dir = build_tiny_model(tiny_dir / "dense", kind="dense", tokenizer_dir=tokenizer_dir)
    from_model = transformers.AutoTokenizer.from_pretrained(model_dir)
    from_tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for text in TEXTS:
        assert from_model.encode(text) == from_tokenizer.encode(text)
