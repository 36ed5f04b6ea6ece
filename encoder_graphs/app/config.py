"""The caption run's settings: plain Python, so the command line can check them before it loads
torch or a model."""

import hashlib
import os
import re
import string
from dataclasses import dataclass, field, replace

from encoder_graphs.app.names import as_text, is_text

DEFAULT_PROMPT = "Describe this in one sentence."
# What a prompt template may name: the file's name without its extension, its folder's name, and
# the image's size in pixels (a video's frame size as decoded).
PROMPT_FIELDS = ("name", "folder", "width", "height")
# A prompt is an instruction, not a document: 64 KiB is some 16,000 tokens. Bounded when the
# arguments are checked, before a model loads (a 100 MB prompt file took a minute to fail).
MAX_PROMPT_BYTES = 64 << 10
MAX_FIELD_WIDTH = 256  # the widths and precisions a prompt's format specs may ask for
# Files a GPU from which the command compiles (job.wants_compile): on 4,096 photos (H200) compiling
# cost 24 s of start and saved 2% of the loop, so it pays from about 32,000 files a GPU.
COMPILE_FROM_FILES = 40_000
# Videos a GPU from which `--video-decoder auto` takes NVDEC (`nvdec.chosen`): its 15 workers start
# slower than the CPU's (64 clips, H200: 0.89x end to end) and decode faster (256: 1.20x); the two
# runs' walls cross near 120 clips (benchmarks/RESULTS.md).
NVDEC_FROM_VIDEOS = 128
# The resolution policy's default: vision tokens an image (or a video frame) may become, the top
# of the Qwen team's 256-1280 guidance; 1,003,520 pixels for 28-pixel tokens (Qwen2/2.5-VL),
# 1,310,720 for 32-pixel ones (Qwen3-VL). A token cap rather than a pixel one: the encoder's and
# the prefill's work and the KV cache grow with tokens, so one number costs the same everywhere.
DEFAULT_IMAGE_TOKENS = 1280
# The video resolution policy's default: vision tokens a pair of frames (one temporal patch) may
# become, 200,704 pixels a frame for Qwen2/2.5-VL: a 16-frame clip is 2,048 tokens rather than the
# 6,144 of Qwen2.5-VL's own 768 (what each costs and saves: benchmarks/RESULTS.md).
DEFAULT_FRAME_TOKENS = 256


def default_load_workers() -> int:
    """Threads decoding and preprocessing files: every core but the one feeding the GPU, up to 16
    (decoding and resizing a phone photo takes tens of ms of one core, and the threads release
    the GIL in PIL's decoder and torch's resize)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(2, min(16, cores - 1))


@dataclass(frozen=True)
class CaptionConfig:
    # None: the model's own (`CaptionInputs.default_prompt`, else DEFAULT_PROMPT), which
    # `with_prompt_of` settles once the model's files are read.
    prompt: str | None = DEFAULT_PROMPT
    # Named prompts, (name, template) in the order given: each file is captioned with each, in one
    # pass (`decoder/shared.py`); `prompt` is then the first's. Empty: the one unnamed `prompt`.
    named: tuple[tuple[str, str], ...] = ()
    max_new_tokens: int = 32
    batch_size: int = 8
    max_batch_tokens: int = 16384  # vision placeholder tokens in one generate call
    # Videos batch apart from images, by their own limits (None: the images'): a clip's prompt is
    # several photos long, and photos batched by a clip's bound would fill a fraction of the GPU.
    video_batch_size: int | None = None
    video_max_batch_tokens: int | None = None
    load_workers: int = field(default_factory=default_load_workers)
    # Batches of files loading ahead of the model. A torchrun rank claims files as its loaders
    # take them, so there the caption command loads one batch ahead: with four, the rank that
    # started first claimed the largest files and the job waited on it (benchmarks/HISTORY.md).
    prefetch_batches: int = 4
    prefix: str = ""  # put before the caption in sidecars and the record's "text" (trigger words)
    suffix: str = ""
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # when sampling: each file's draws from its own seed (seed_for)

    def __post_init__(self) -> None:
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt must not be empty")
        for name in ("max_new_tokens", "batch_size", "max_batch_tokens", "load_workers", "prefetch_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("video_batch_size", "video_max_batch_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for template in self.templates:
            check_template(template)
        named = tuple((f"--prompt {name}", text) for name, text in self.named)
        for flag, text in (("--prompt", self.prompt or ""), *named, ("--prefix", self.prefix), ("--suffix", self.suffix)):
            if not is_text(text):  # bytes a shell passed that are not UTF-8: no file or model takes them
                raise ValueError(f"{flag} is not valid UTF-8 text")

    def batch_limits(self, kind: str) -> tuple[int, int]:
        """The most files and vision tokens one generate call of `kind` ("image", "video") takes."""
        if kind == "video":
            return self.video_batch_size or self.batch_size, self.video_max_batch_tokens or self.max_batch_tokens
        return self.batch_size, self.max_batch_tokens

    @property
    def largest_batch(self) -> int:
        return max(self.batch_size, self.video_batch_size or 0)

    def with_prompt_of(self, model_prompt: str | None) -> "CaptionConfig":
        """This config, its prompt the model's (`model_prompt`, else DEFAULT_PROMPT) where none was given."""
        return self if self.prompt is not None else replace(self, prompt=model_prompt or DEFAULT_PROMPT)

    @property
    def templates(self) -> list[str]:
        """The prompt templates a file is captioned with: the named ones, else the one prompt."""
        return [template for _, template in self.named] or ([self.prompt] if self.prompt is not None else [])

    def prompt_for(self, name: str, folder: str, width: int, height: int) -> str:
        """The prompt of one file: the template with its fields filled in (a name's bytes that are
        not UTF-8 as U+FFFD: the tokenizer takes text only; `shielded`)."""
        return self.prompts_for(name, folder, width, height)[0]

    def prompts_for(self, name: str, folder: str, width: int, height: int) -> list[str]:
        """Each of `templates` for one file, as `prompt_for` fills them in."""
        fields = {"name": shielded(name), "folder": shielded(folder), "width": width, "height": height}
        return [template.format(**fields) for template in self.templates]

    def seed_for(self, name: str) -> int:
        """The sampling seed of the file at `name` (its path within its root): from the run's seed
        and the name only, so a file draws the same tokens in any batch, beside any other files,
        in a resumed run as in an uninterrupted one."""
        key = f"{self.seed}\0{name}".encode("utf-8", "surrogatepass")  # undecodable names too
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) >> 1  # < 2**63

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


def shielded(name: str) -> str:
    """A file or folder name as prompt text that the tokenizer cannot read as special tokens: a
    name such as `<|im_end|><|im_start|>.jpg` would end the user's turn and start another (every
    family's special tokens begin with "<"); a zero-width space after each "<" keeps it text."""
    return as_text(name).replace("<", "<\u200b")


def check_template(prompt: str) -> None:
    """A prompt template whose every filled-in prompt stays small: at most MAX_PROMPT_BYTES, only
    PROMPT_FIELDS, no conversions (!r), no fields nested in a format spec (`{name:{width}}` would
    take the image's width as its own), widths and precisions up to MAX_FIELD_WIDTH. Raises
    ValueError naming what is wrong."""
    size = len(prompt.encode("utf-8", "surrogatepass"))
    if size > MAX_PROMPT_BYTES:
        raise ValueError(f"the prompt is {size} bytes, more than the {MAX_PROMPT_BYTES} bytes a prompt may have")
    try:
        parsed = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(prompt)]
    except ValueError as error:
        raise ValueError(f"bad prompt template {prompt!r}: {error}") from error
    fields = [item for item in parsed if item[0] is not None]
    if unknown := sorted({name for name, _, _ in fields} - set(PROMPT_FIELDS)):
        names = ", ".join("{" + f + "}" for f in unknown)
        raise ValueError(f"the prompt names {names}; it may use {', '.join('{' + f + '}' for f in PROMPT_FIELDS)} "
                         "(write {{ and }} for literal braces)")
    for name, spec, conversion in fields:
        field_text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if conversion is not None:
            raise ValueError(f"the prompt's {field_text}: fields take no conversion (!{conversion})")
        if "{" in spec:
            raise ValueError(f"the prompt's {field_text}: nested fields in a format spec are not allowed")
        if spec.endswith("c"):  # a number as a character: a surrogate or a control character
            raise ValueError(f"the prompt's {field_text}: 'c' turns the number into a character; write {{{name}}}")
        if any(int(number) > MAX_FIELD_WIDTH for number in re.findall(r"\d+", spec)):
            raise ValueError(f"the prompt's {field_text}: widths and precisions go up to {MAX_FIELD_WIDTH}")
    try:  # the format specs themselves, with the longest values a file gives
        prompt.format(name="n" * 255, folder="f" * 255, width=99999, height=99999)
    except ValueError as error:
        raise ValueError(f"bad prompt template {prompt!r}: {error}") from error
