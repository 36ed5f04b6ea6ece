"""The embedded default model: a tiny random-weight Qwen2-VL built once and cached on disk.

Its captions are noise. It exists so that the command runs on a fresh CPU machine with no
download; point `--model` at a real checkpoint directory for real captions.

The cache directory holds what a Hub checkpoint holds (config, safetensors weights, tokenizer,
chat template, image and video processor configs), so it loads through the real
`from_pretrained` paths.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Tokenizer, Qwen2VLForConditionalGeneration

from encoder_graphs.models.presets import get_config
from encoder_graphs.models.transformers_seam import from_config

VERSION = 1
PRESET = "tiny-qwen2-vl"
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224
VIDEO_MAX_PIXELS = 112 * 112

# Ids fixed to match the tiny presets' config (vocab 256, bos 0, eos 1, vision tokens 250-253), so
# this tokenizer also serves `--model tiny-qwen2-vl` and the other tiny presets.
SPECIAL_TOKENS = {
    "<|endoftext|>": 0,
    "<|im_end|>": 1,
    "<|im_start|>": 2,
    "<|image_pad|>": 250,
    "<|video_pad|>": 251,
    "<|vision_start|>": 252,
    "<|vision_end|>": 253,
}
VOCAB_SIZE = 256

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_root() -> Path:
    override = os.environ.get("ENCODER_GRAPHS_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "encoder-graphs"


def default_model_dir() -> Path:
    """The cached default model directory, built on first use."""
    target = cache_root() / f"{PRESET}-v{VERSION}"
    if not (target / "config.json").is_file():
        build_default_model(target)
    return target


def build_default_model(target: Path) -> None:
    """Write the model into a temp dir beside `target`, then rename: a killed build leaves no
    half cache, and two concurrent builds both end with a complete directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_model(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_tokenizer(
    special_tokens: dict[str, int] = SPECIAL_TOKENS, named_tokens: dict[str, str] | None = None
) -> Qwen2Tokenizer:
    """Byte-level tokenizer with no merges: one token per byte, `special_tokens` at fixed ids
    (`<|endoftext|>` pads, `<|im_end|>` ends); `named_tokens` become named attributes
    (`tokenizer.context_image_token` ...), as InternVL's processor reads them.

    256 ids cannot hold 256 bytes and the specials, so the rarest bytes (control bytes from 0x01)
    have no token and are dropped when encoding.
    """
    free_ids = [i for i in range(VOCAB_SIZE) if i not in special_tokens.values()]
    dropped = set(range(1, 1 + len(special_tokens)))
    kept_bytes = [b for b in range(256) if b not in dropped]
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: i for b, i in zip(kept_bytes, free_ids, strict=True)}
    vocab.update(special_tokens)
    extra = named_tokens or [t for t in special_tokens if t not in ("<|endoftext|>", "<|im_end|>")]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", extra_special_tokens=extra
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _write_model(directory: Path) -> None:
    config = get_config(PRESET)
    tokenizer = build_tokenizer()
    for name, token_id in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        if getattr(config, name) != SPECIAL_TOKENS[token_id]:
            raise RuntimeError(f"preset {PRESET} has {name}={getattr(config, name)}, tokenizer has {token_id}")
    if config.text_config.vocab_size != VOCAB_SIZE:
        raise RuntimeError(f"preset {PRESET} vocab {config.text_config.vocab_size} != tokenizer {VOCAB_SIZE}")
    torch.manual_seed(0)
    model = from_config(Qwen2VLForConditionalGeneration, config, torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=SPECIAL_TOKENS["<|endoftext|>"],
        eos_token_id=SPECIAL_TOKENS["<|im_end|>"],
        pad_token_id=SPECIAL_TOKENS["<|endoftext|>"],
    )
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    _write_processor_configs(directory)


def _write_processor_configs(directory: Path) -> None:
    """Image, video and processor configs, and the chat template, as a Hub checkpoint has them."""
    patch = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    normalize = dict(
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        do_convert_rgb=True,
        do_resize=True,
    )
    # Written as JSON rather than through the processor classes: Qwen2VLVideoProcessor (and so
    # Qwen2VLProcessor) cannot be built without torchvision, but loading them where torchvision
    # exists must still work.
    write_json(
        directory / "preprocessor_config.json",
        dict(
            image_processor_type="Qwen2VLImageProcessor",
            processor_class="Qwen2VLProcessor",
            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
            **patch,
            **normalize,
        ),
    )
    write_json(
        directory / "video_preprocessor_config.json",
        dict(
            video_processor_type="Qwen2VLVideoProcessor",
            processor_class="Qwen2VLProcessor",
            size={"shortest_edge": MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
            do_sample_frames=False,
            **patch,
            **normalize,
        ),
    )
    write_json(directory / "processor_config.json", dict(processor_class="Qwen2VLProcessor"))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)


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
