"""A byte-level tokenizer with no merges (one token per byte) and special tokens at chosen ids: what
the random-weight models and presets speak, for any vocabulary size."""

import json
from pathlib import Path

from transformers import Qwen2Tokenizer


def build_tokenizer(
    special_tokens: dict[str, int], named_tokens: dict[str, str] | None = None, *, vocab_size: int = 256
) -> Qwen2Tokenizer:
    """Bytes take the lowest ids the specials leave free; `<|endoftext|>` pads and `<|im_end|>`
    ends; `named_tokens` become named attributes (`tokenizer.context_image_token` ...), as
    InternVL's processor reads them. Where `vocab_size` cannot hold 256 bytes and the specials,
    the rarest bytes (control bytes from 0x01) have no token and are dropped when encoding."""
    taken = set(special_tokens.values())
    if max(taken) >= vocab_size:
        raise ValueError(f"special token ids {sorted(taken)} do not fit a vocabulary of {vocab_size}")
    free_ids = [i for i in range(min(vocab_size, 256 + len(taken))) if i not in taken][:256]
    dropped = set(range(1, 1 + 256 - len(free_ids)))
    kept_bytes = [b for b in range(256) if b not in dropped]
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: i for b, i in zip(kept_bytes, free_ids, strict=True)}
    vocab.update(special_tokens)
    extra = named_tokens or [t for t in special_tokens if t not in ("<|endoftext|>", "<|im_end|>")]
    return Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=extra
    )


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte to printable-character map, which byte-level BPE tokenizers use."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
