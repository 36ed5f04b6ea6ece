"""The caption run's settings: plain Python, so the command line can check them before it loads
torch or a model."""

import os
import string
from dataclasses import dataclass, field

from encoder_graphs.app.names import as_text

DEFAULT_PROMPT = "Describe this in one sentence."
# What a prompt template may name: the file's name without its extension, its folder's name, and
# the image's size in pixels (a video's frame size as decoded).
PROMPT_FIELDS = ("name", "folder", "width", "height")
COMPILE_FROM_FILES = 2000  # files a GPU from which the command compiles the encoder blocks (command.wants_compile)
# The resolution policy's default: vision tokens an image (or a video frame) may become, the top
# of the Qwen team's 256-1280 guidance; 1,003,520 pixels for 28-pixel tokens (Qwen2/2.5-VL),
# 1,310,720 for 32-pixel ones (Qwen3-VL). A token cap rather than a pixel one: the encoder's and
# the prefill's work and the KV cache grow with tokens, so one number costs the same everywhere.
DEFAULT_IMAGE_TOKENS = 1280


def default_load_workers() -> int:
    """Threads decoding and preprocessing files: every core but the one feeding the GPU, up to 16
    (a 12 MP JPEG takes ~60 ms of one core at the default resolution, and the threads release
    the GIL in PIL's decoder and torch's resize)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(2, min(16, cores - 1))


@dataclass(frozen=True)
class CaptionConfig:
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 32
    batch_size: int = 8
    max_batch_tokens: int = 16384  # vision placeholder tokens in one generate call
    load_workers: int = field(default_factory=default_load_workers)
    # Batches of files loading ahead of the model. A torchrun rank claims files as its loaders
    # take them, so there the caption command loads one batch ahead: four let the first rank to
    # start claim the 256 largest of 512 files (2 H200s, 1.71x one GPU, 2026-11-22).
    prefetch_batches: int = 4
    prefix: str = ""  # put before the caption in sidecars and the record's "text" (trigger words)
    suffix: str = ""
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ValueError("prompt must not be empty")
        for name in ("max_new_tokens", "batch_size", "max_batch_tokens", "load_workers", "prefetch_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        try:
            fields = {field for _, field, _, _ in string.Formatter().parse(self.prompt) if field is not None}
            unknown = sorted(fields - set(PROMPT_FIELDS))
            if not unknown:
                self.prompt_for("name", "folder", 1, 1)  # format specs, conversions
        except (ValueError, IndexError, KeyError) as error:
            raise ValueError(f"bad prompt template {self.prompt!r}: {error}") from error
        if unknown:
            names = ", ".join("{" + f + "}" for f in unknown)
            raise ValueError(f"the prompt names {names}; it may use {', '.join('{' + f + '}' for f in PROMPT_FIELDS)}")

    def prompt_for(self, name: str, folder: str, width: int, height: int) -> str:
        """The prompt of one file: the template with its fields filled in (a name's bytes that are
        not UTF-8 as U+FFFD: the tokenizer takes text only)."""
        return self.prompt.format(name=as_text(name), folder=as_text(folder), width=width, height=height)

    def text(self, caption: str) -> str:
        """The caption with the prefix and suffix around it."""
        return f"{self.prefix}{caption}{self.suffix}"

    @property
    def sampling(self) -> dict:
        """`generate` settings: greedy, or temperature / top-p sampling through the decoder graphs
        (top_k=0: transformers' default top-k of 50 is not in the graphs)."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
