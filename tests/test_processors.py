"""Our hand-built Qwen-VL inputs (`QwenVLInputs`, no torchvision) against the official
`AutoProcessor` of the same checkpoint directory, for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: ids,
masks, token types, pixels, grids, Qwen2.5-VL's second_per_grid_ts and Qwen3-VL's timestamps.

The processors need torchvision, so this module is skipped where it is missing (CI); the GPU
machine has it. The checkpoint directories hold the tiny presets' configs, the tiny tokenizer
(whose own chat template differs from the processor's, as a checkpoint's may) and processor
configs laid out as on the Hub for each family.
"""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_graphs.models.qwen.inputs import QwenVLInputs
from encoder_graphs.presets import get_config
from encoder_graphs.presets.default_model import SPECIAL_TOKENS
from encoder_graphs.presets.files import QWEN_CHAT_TEMPLATE
from encoder_graphs.presets.tokenizer import build_tokenizer

pytest.importorskip("torchvision")
pytestmark = pytest.mark.torchvision

from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

# Qwen2-VL-2B-Instruct's and Qwen2.5-VL's chat template (chat_template.json on the Hub).
QWEN2_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL-Instruct's chat template, its vision and user parts (no tools, no thinking).
QWEN3_TEMPLATE = """{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                <|vision_start|><|image_pad|><|vision_end|>
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                <|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content, false) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, True) %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_CLIP = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
_HALF = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
_PATCH14 = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
_PATCH16 = dict(patch_size=16, temporal_patch_size=2, merge_size=2)

# Per family: preset, processor class, chat template, image and video processor configs, laid
# out as the Hub checkpoints have them (pixel limits shrunk to tiny sizes).
FAMILIES = {
    # Qwen2-VL on the Hub: min_pixels / max_pixels keys and no video config, so the video
    # processor reads preprocessor_config.json.
    "qwen2-vl": dict(
        preset="tiny-qwen2-vl",
        processor="Qwen2VLProcessor",
        template=QWEN2_TEMPLATE,
        image=dict(
            image_processor_type="Qwen2VLImageProcessor", min_pixels=56 * 56, max_pixels=224 * 224, **_PATCH14, **_CLIP
        ),
        video=None,
    ),
    "qwen2.5-vl": dict(
        preset="tiny-qwen2.5-vl",
        processor="Qwen2_5_VLProcessor",
        template=QWEN2_TEMPLATE,
        image=dict(
            image_processor_type="Qwen2VLImageProcessor",
            size={"shortest_edge": 56 * 56, "longest_edge": 224 * 224},
            **_PATCH14,
            **_CLIP,
        ),
        video=dict(
            video_processor_type="Qwen2VLVideoProcessor",
            size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
            **_PATCH14,
            **_CLIP,
        ),
    ),
    # Qwen3-VL: patch 16, mean and std 0.5, and a video budget for the whole clip (frames x pixels).
    "qwen3-vl": dict(
        preset="tiny-qwen3-vl",
        processor="Qwen3VLProcessor",
        template=QWEN3_TEMPLATE,
        image=dict(
            image_processor_type="Qwen2VLImageProcessorFast",
            size={"shortest_edge": 64 * 64, "longest_edge": 256 * 256},
            **_PATCH16,
            **_HALF,
        ),
        video=dict(
            video_processor_type="Qwen3VLVideoProcessor",
            size={"shortest_edge": 4096, "longest_edge": 16 * 64 * 64},
            fps=2,
            do_sample_frames=True,
            **_PATCH16,
            **_HALF,
        ),
    ),
}
# Qwen3.5 checkpoints take the same processor as Qwen3-VL (transformers' processing_auto).
FAMILIES["qwen3.5"] = dict(FAMILIES["qwen3-vl"], preset="tiny-qwen3.5")
PROMPT = "Describe this."
IMAGE_SIZES = [(56, 56), (224, 224), (100, 60), (64, 48), (300, 200), (640, 480), (33, 500), (1000, 30), (20, 20)]


def write_checkpoint(directory: Path, family: str) -> Path:
    spec = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    get_config(spec["preset"]).save_pretrained(directory)
    tokenizer = build_tokenizer(SPECIAL_TOKENS)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE  # the tiny one, not the processor's
    tokenizer.save_pretrained(directory)

    def write(name: str, payload: dict) -> None:
        (directory / name).write_text(json.dumps(payload, indent=2) + "\n")

    write("preprocessor_config.json", dict(spec["image"], processor_class=spec["processor"]))
    if spec["video"] is not None:
        write("video_preprocessor_config.json", dict(spec["video"], processor_class=spec["processor"]))
    write("chat_template.json", {"chat_template": spec["template"]})
    return directory


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family, our inputs, the official processor) for one family's tiny checkpoint."""
    directory = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    processor = AutoProcessor.from_pretrained(directory)
    processor.tokenizer.padding_side = "left"  # batched generation pads on the left, as we do
    assert type(processor).__name__ == FAMILIES[request.param]["processor"]
    return request.param, QwenVLInputs.from_pretrained(directory), processor


def noise(size: tuple[int, int], seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), np.uint8))
    return image.convert(mode) if mode != "RGB" else image


def clip(count: int, size: tuple[int, int] = (84, 60), seed: int = 0) -> list[Image.Image]:
    """`count` frames of smooth, moving content (resizing noise is the harder test; this is a video)."""
    width, height = size
    ys, xs = np.mgrid[0:height, 0:width]
    frames = []
    for index in range(count):
        phase = seed + 7 * index
        pixels = np.stack([(xs * 3 + phase) % 256, (ys * 5 + 2 * phase) % 256, (xs + ys + 3 * phase) % 256], -1)
        frames.append(Image.fromarray(pixels.astype(np.uint8)))
    return frames


def official(processor, items: list[tuple[str, object, object]], **settings) -> dict:
    """The processor's batch for `items` ((kind, image or frames, video metadata or None)), each
    item its own prompt, as a caller following the model card writes it (`settings`: more
    processor arguments, e.g. `max_pixels`)."""
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": PROMPT}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for kind, _, _ in items
    ]
    kwargs = {}
    images = [media for kind, media, _ in items if kind == "image"]
    videos = [(media, metadata) for kind, media, metadata in items if kind == "video"]
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = [frames for frames, _ in videos]
        kwargs["do_sample_frames"] = False  # the frames are already chosen
        if any(metadata is not None for _, metadata in videos):
            kwargs["video_metadata"] = [metadata for _, metadata in videos]
    return dict(processor(text=texts, padding=True, return_tensors="pt", **kwargs, **settings))


def ours(inputs: QwenVLInputs, items: list[tuple[str, object, object]]) -> dict:
    encoded = [
        inputs.encode_image(media) if kind == "image" else inputs.encode_video(media, metadata)
        for kind, media, metadata in items
    ]
    return inputs.batch(encoded, PROMPT)


def assert_same(mine: dict, theirs: dict) -> None:
    assert set(mine) == set(theirs), f"keys: ours {sorted(mine)}, processor {sorted(theirs)}"
    for key, expected in theirs.items():
        actual = mine[key]
        assert actual.dtype == expected.dtype, f"{key}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{key}: {tuple(actual.shape)} != {tuple(expected.shape)}"
        if key.startswith("pixel_values"):
            # The same uint8 resize and float32 arithmetic: equal but for the last bit at most.
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=key)
        elif key == "second_per_grid_ts":
            torch.testing.assert_close(actual, expected, rtol=1e-7, atol=0, msg=key)
        else:
            assert torch.equal(actual, expected), f"{key} differs"


@pytest.mark.parametrize("size", IMAGE_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_single_image(checkpoint, size):
    _, inputs, processor = checkpoint
    items = [("image", noise(size, seed=size[0] * 1000 + size[1]), None)]
    assert_same(ours(inputs, items), official(processor, items))


def test_grayscale_image(checkpoint):
    _, inputs, processor = checkpoint
    items = [("image", noise((90, 70), seed=3, mode="L"), None)]
    assert_same(ours(inputs, items), official(processor, items))


@pytest.mark.parametrize("frames", [2, 3, 4, 8, 16])
def test_video_with_metadata(checkpoint, frames):
    """Frames sampled evenly from a 30 fps, 10 s clip, as the caption pipeline samples them."""
    _, inputs, processor = checkpoint
    indices = np.linspace(0, 299, frames).round().astype(int).tolist()
    metadata = VideoMetadata(total_num_frames=300, fps=30.0, frames_indices=indices)
    items = [("video", clip(frames, seed=frames), metadata)]
    assert_same(ours(inputs, items), official(processor, items))


@pytest.mark.parametrize("frames", [2, 5, 6])
def test_video_without_metadata(checkpoint, frames):
    """No metadata: both sides take the processors' default (24 fps, consecutive frames)."""
    _, inputs, processor = checkpoint
    items = [("video", clip(frames, size=(120, 90), seed=frames), None)]
    assert_same(ours(inputs, items), official(processor, items))


def test_large_frames_are_shrunk_alike(checkpoint):
    """Frames above the video pixel limit: Qwen2 families shrink each frame, Qwen3-VL the clip."""
    _, inputs, processor = checkpoint
    frames = [noise((320, 240), seed=i) for i in range(4)]
    metadata = {"total_num_frames": 100, "fps": 25.0, "frames_indices": [0, 33, 66, 99]}
    items = [("video", frames, VideoMetadata(**metadata))]
    mine = ours(inputs, [("video", frames, metadata)])  # a plain mapping works as well
    assert_same(mine, official(processor, items))


@pytest.mark.parametrize("tokens", [16, 40])
def test_resolution_policy_equals_the_processor_given_that_max_pixels(checkpoint, tokens):
    """`max_image_tokens` (the caption command's `--max-image-tokens`) shrinks an image as the
    processor does with `max_pixels` = tokens x (patch x merge)^2 (the model card's
    `from_pretrained(..., max_pixels=)`; per call, `size`'s longest edge: transformers 5.17 ignores
    a `max_pixels` call argument)."""
    _, inputs, processor = checkpoint
    capped = QwenVLInputs(
        inputs.tokenizer, inputs.image_processor, model_type=inputs.model_type,
        chat_template=inputs.chat_template, max_image_tokens=tokens,
    )
    for size in [(640, 480), (300, 200), (33, 500)]:
        items = [("image", noise(size, seed=size[0]), None)]
        mine = ours(capped, items)
        assert mine["image_grid_thw"].prod() // capped.image.merge_size**2 <= tokens
        size = {"longest_edge": tokens * capped.factor**2, "shortest_edge": capped.image.min_pixels}
        assert_same(mine, official(processor, items, size=size))
    assert capped.max_image_pixels == tokens * capped.factor**2 < inputs.max_image_pixels


def test_mixed_batch(checkpoint):
    """Images and videos of different sizes and prompt lengths in one left-padded batch."""
    family, inputs, processor = checkpoint
    items = [
        ("image", noise((100, 60), seed=1), None),
        ("video", clip(4, seed=2), VideoMetadata(total_num_frames=48, fps=24.0, frames_indices=[0, 15, 31, 47])),
        ("image", noise((280, 280), seed=3), None),
        (
            "video",
            clip(6, size=(64, 64), seed=4),
            VideoMetadata(total_num_frames=900, fps=29.97, frames_indices=[0, 180, 360, 539, 719, 899]),
        ),
        ("image", noise((40, 300), seed=5), None),
    ]
    mine, theirs = ours(inputs, items), official(processor, items)
    assert_same(mine, theirs)
    assert (theirs["attention_mask"] == 0).any(), "the batch must exercise padding"
    if family == "qwen2.5-vl":
        assert theirs["second_per_grid_ts"].tolist() == pytest.approx([2 / (4 / 48 * 24.0), 2 / (6 / 900 * 29.97)])


def test_qwen3_prompt_has_the_frame_times(checkpoint):
    """Qwen3-VL's and Qwen3.5's prompt names each temporal patch's mean time; the others' has no times."""
    family, inputs, _ = checkpoint
    metadata = {"total_num_frames": 300, "fps": 30.0, "frames_indices": [0, 30, 60, 90]}
    item = inputs.encode_video(clip(4), metadata)
    text = inputs.tokenizer.decode(inputs.batch([item], PROMPT)["input_ids"][0])
    if family in ("qwen3-vl", "qwen3.5"):
        assert item.timestamps == (0.5, 2.5)
        assert "<0.5 seconds><|vision_start|><|video_pad|>" in text and "<2.5 seconds>" in text
    else:
        assert "seconds>" not in text


def test_decoded_clip_equals_the_processor_given_its_frames(checkpoint, tmp_path):
    """The video decoder's frames (sampled by seeking, scaled once to the model's `frame_size`)
    and their timing: the processor given the same frames and metadata makes the same batch
    (its resize of frames already at its size changes nothing)."""
    pytest.importorskip("av")
    from test_video import write_h264

    from encoder_graphs.app.decoders import decode_video
    from encoder_graphs.app.media import LoadLimits

    _, inputs, processor = checkpoint
    write_h264(tmp_path / "clip.mp4", frames=75, size=(320, 180), fps=25)
    video = decode_video(tmp_path / "clip.mp4", LoadLimits(max_frames=6, frame_size=inputs.frame_size, min_side=28))
    assert video.metadata == {"fps": 25.0, "frames_indices": [0, 15, 30, 44, 59, 74], "total_num_frames": 75}
    items = [("video", [Image.fromarray(frame) for frame in video.frames], VideoMetadata(**video.metadata))]
    assert_same(inputs.batch([inputs.encode_video(video.frames, video.metadata)], PROMPT), official(processor, items))


@pytest.mark.parametrize("tokens", [None, 12])
def test_frames_scaled_as_decoded_equal_the_processor_given_full_frames(checkpoint, tmp_path, tokens):
    """Frames shrunk once in the decoder's worker, as they are decoded, against the processor
    given the full-size frames and resizing them itself: the same batch, pixels too; with
    `max_frame_tokens` (the command's `--max-frame-tokens`) as with the processor given that
    `max_pixels` (Qwen3-VL's bounds the clip: 6 frames of it)."""
    pytest.importorskip("av")
    from test_video import write_h264

    from encoder_graphs.app.decoders import decode_video
    from encoder_graphs.app.media import LoadLimits

    _, inputs, processor = checkpoint
    settings = {}
    if tokens is not None:
        inputs = QwenVLInputs(inputs.tokenizer, inputs.image_processor, inputs.video, model_type=inputs.model_type,
                              chat_template=inputs.chat_template, max_frame_tokens=tokens)
        pixels = tokens * inputs.video.factor**2
        if inputs.video.clip_budget:
            settings["size"] = {"longest_edge": 6 * pixels, "shortest_edge": inputs.video.min_pixels}
        else:
            settings["size"] = {"longest_edge": pixels, "shortest_edge": inputs.video.min_pixels}
    write_h264(tmp_path / "clip.mp4", frames=75, size=(320, 180), fps=25)
    limits = LoadLimits(max_frames=6, min_side=28)
    scaled = decode_video(tmp_path / "clip.mp4", replace(limits, frame_size=inputs.frame_size))
    full = decode_video(tmp_path / "clip.mp4", replace(limits, frame_size=(320, 180)))
    assert scaled.metadata == full.metadata
    mine = inputs.batch([inputs.encode_video(scaled.frames, scaled.metadata)], PROMPT)
    items = [("video", [Image.fromarray(frame) for frame in full.frames], VideoMetadata(**full.metadata))]
    assert_same(mine, official(processor, items, **settings))
    assert scaled.frames.shape[1:3] != full.frames.shape[1:3]  # the decoder did shrink them


def test_longest_prompt_bounds_the_largest_inputs(checkpoint):
    """No image or video the loader lets through makes a longer prompt than `longest_prompt`."""
    _, inputs, _ = checkpoint
    max_frames = 8
    longest = inputs.longest_prompt(PROMPT, max_frames)
    side = int(inputs.max_frame_pixels**0.5)
    metadata = {"total_num_frames": 10**6, "fps": 10.0, "frames_indices": list(range(0, 10**6, 10**6 // max_frames))}
    candidates = [
        inputs.encode_image(noise((4000, 3000), seed=0)),
        inputs.encode_video(clip(max_frames, size=(side, side)), metadata),
        inputs.encode_video(clip(2, size=(side, side)), {**metadata, "frames_indices": [0, 999999]}),
    ]
    for item in candidates:
        assert inputs.batch([item], PROMPT)["input_ids"].shape[1] <= longest
