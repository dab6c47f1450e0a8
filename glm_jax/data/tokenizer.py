"""Byte-level BPE trained with the `tokenizers` package; decode(encode(x)) == x for any text."""

from __future__ import annotations

from pathlib import Path

from glm_jax.extras import require

require("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402 (after the check)

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_bpe(texts: list[str], *, vocab_size: int, special_tokens=(EOS, PAD)) -> Tokenizer:
    """A deterministic byte-level BPE of at most vocab_size tokens (special tokens first)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, directory: str | Path) -> Path:
    path = Path(directory) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a model directory carries the tokenizer it was "
                                "trained with (train.py writes tokenizer.json)")
    return Tokenizer.from_file(str(path))


def eos_id(tok: Tokenizer) -> int:
    return tok.token_to_id(EOS)


def stop_token(cfg, tok: Tokenizer | None) -> int | None:
    """The token that ends a completion: the config's eos_token_id (the first of a list) if set,
    else the tokenizer's end-of-text token (None without a tokenizer)."""
    eos = cfg.eos_token_id
    if isinstance(eos, (tuple, list)):
        eos = eos[0] if eos else None
    if eos is None and tok is not None:
        eos = eos_id(tok)
    return eos
