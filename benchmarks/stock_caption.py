"""What a user writes without encoder-graphs: the official processor and `model.generate`, in
batches of 8, over the same files at the same resolution policy, captions to JSONL. Given its
best plain settings: bf16, the fast (torchvision) processor running its resize on the GPU, files
decoded on threads one batch ahead, left padding, greedy. Prints one JSON line of timings.
Videos (.mp4 .webm .mkv .avi .mov .m4v) too, in the same batches as the images: 16 frames each,
evenly over the clip, read by transformers' own `load_video` (torchcodec where installed, as the
processor does given a path; else PyAV) and given to the processor as frames with their
`video_metadata` (which times them: Qwen2.5-VL's `second_per_grid_ts`); for Qwen, frames of at
most `--max-frame-tokens` tokens, the caption command's default.
    python3 benchmarks/stock_caption.py FOLDER --preset qwen2.5-vl-3b [--max-image-tokens 1280]
        [--max-frames 16] [--max-frame-tokens 256|model] --out out.jsonl
DeepSeek-OCR (no chat template): "<image>\n" + the prompt, "Free OCR." unless given, as its model card.
"""

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import replace  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageOps  # noqa: E402
from transformers import AutoProcessor, AutoVideoProcessor  # noqa: E402
from transformers.video_utils import VideoMetadata, default_sample_indices_fn, load_video  # noqa: E402

from encoder_graphs.app.config import DEFAULT_PROMPT  # noqa: E402
from encoder_graphs.models.registry import family_for_config  # noqa: E402
from encoder_graphs.presets import build_model  # noqa: E402
from encoder_graphs.presets.files import preset_files_dir  # noqa: E402

EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp"}
VIDEO_EXTENSIONS = {".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v"}
Video = tuple[object, VideoMetadata]  # frames (an array or tensor of [frames, ...]) and where they come from


def open_image(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def video_backend() -> str:
    """transformers' video reader: torchcodec where installed (what its video processors use
    given a path), else PyAV (torchvision's reader is gone from torchvision 0.26)."""
    return "torchcodec" if importlib.util.find_spec("torchcodec") else "pyav"


def count_frames(path: Path) -> int:
    """Frames in a video whose container does not say (WebM, Matroska), from its packets."""
    import av  # here: an image folder needs no PyAV

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return sum(1 for packet in container.demux(stream) if packet.size)


def open_video(path: Path, frames: int, backend: str) -> Video:
    """`frames` frames evenly over the video, by transformers' `load_video` and its default
    sampling. Its PyAV reader takes the frame count from the container, which a WebM lacks: it
    would then ask for 16 frames of none; the count comes from the packets instead, as a user
    who met that error would write, and the metadata says it (the processor times frames by it)."""
    total = 0

    def sample(metadata: VideoMetadata, **kwargs) -> np.ndarray:
        nonlocal total
        total = metadata.total_num_frames or count_frames(path)
        return default_sample_indices_fn(replace(metadata, total_num_frames=total), num_frames=min(frames, total))

    video, metadata = load_video(str(path), backend=backend, sample_indices_fn=sample)
    metadata.total_num_frames = total
    metadata.duration = total / metadata.fps if metadata.fps else metadata.duration
    return video, metadata


def open_file(path: Path, frames: int, backend: str) -> Image.Image | Video:
    return open_video(path, frames, backend) if path.suffix.lower() in VIDEO_EXTENSIONS else open_image(path)


def frame_settings(model: torch.nn.Module, processor: object, files: Path, args: argparse.Namespace) -> dict:
    """The video processor's arguments (`videos_kwargs`): the frames come sampled, with their
    metadata (`do_sample_frames` off); for Qwen, frames of at most `--max-frame-tokens` vision
    tokens as the caption command's default makes them, or the checkpoint's own limit ('model':
    the processor loaded above took the images' max_pixels for its frames too)."""
    settings: dict = {"do_sample_frames": False}
    if not model.config.model_type.startswith("qwen"):
        return settings
    shortest = processor.video_processor.size.shortest_edge
    if args.max_frame_tokens is None:
        longest = AutoVideoProcessor.from_pretrained(files).size.longest_edge
    else:
        vision = model.config.vision_config
        longest = args.max_frame_tokens * (vision.patch_size * vision.spatial_merge_size) ** 2
        if model.config.model_type.startswith("qwen3"):  # Qwen3-VL's video processor bounds the whole clip's pixels
            longest *= args.max_frames
    settings["size"] = {"shortest_edge": shortest, "longest_edge": longest}
    return settings


def chat_text(processor: object, prompt: str, kind: str) -> str:
    """The prompt around one image or video, as the model's chat template writes it."""
    if processor.chat_template is None:  # DeepSeek-OCR: plain text after the image, as its model card writes it
        if kind == "video":
            raise SystemExit("this model's processor takes no video")
        return f"{processor.image_token}\n{prompt}"
    return processor.apply_chat_template(
        [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": prompt}]}],
        add_generation_prompt=True, tokenize=False,
    )


def processor_inputs(processor: object, texts: list[str], items: list, settings: dict, frame_kwargs: dict) -> dict:
    """One processor call for a batch: its images, and its videos as frames with their metadata."""
    images = [item for item in items if isinstance(item, Image.Image)]
    videos = [item for item in items if not isinstance(item, Image.Image)]
    call = {"images": images} if images else {}
    if videos:
        call["videos"] = [frames for frames, _ in videos]
        call["videos_kwargs"] = {**frame_kwargs, "video_metadata": [metadata for _, metadata in videos]}
    return processor(text=texts, padding=True, return_tensors="pt", **call, **settings)


def tokens_or_model(text: str) -> int | None:
    """`--max-frame-tokens`: a count, or 'model' (None) for the checkpoint's own limit."""
    return None if text == "model" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--max-image-tokens", type=int, default=1280, help="Qwen: max_pixels = this x (patch x merge)^2")
    parser.add_argument("--max-frames", type=int, default=16, help="frames sampled from each video, evenly")
    parser.add_argument("--max-frame-tokens", type=tokens_or_model, default=256, metavar="N|model",
                        help="Qwen: a video frame's max_pixels = N x (patch x merge)^2; 'model': the processor's own")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", default=None, help="default: the caption command's for this model")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    files = sorted(p for p in args.folder.rglob("*") if p.suffix.lower() in EXTENSIONS | VIDEO_EXTENSIONS)
    is_video = {path: path.suffix.lower() in VIDEO_EXTENSIONS for path in files}
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda")
    resolution = {}  # the model card's way: max_pixels given to from_pretrained
    if model.config.model_type.startswith("qwen"):
        vision = model.config.vision_config
        resolution["max_pixels"] = args.max_image_tokens * (vision.patch_size * vision.spatial_merge_size) ** 2
    processor = AutoProcessor.from_pretrained(preset_files_dir(args.preset), **resolution)
    processor.tokenizer.padding_side = "left"
    loaded = time.perf_counter()
    settings = {"device": "cuda"}  # the fast image processor resizes and normalises on the GPU
    prompt = args.prompt
    if prompt is None:  # the caption command's for this model
        prompt = family_for_config(model.config).inputs.default_prompt or DEFAULT_PROMPT
    kinds = {"video" if video else "image" for video in is_video.values()}
    texts = {kind: chat_text(processor, prompt, kind) for kind in kinds}
    frame_kwargs = frame_settings(model, processor, preset_files_dir(args.preset), args) if "video" in kinds else {}
    backend = video_backend()
    load = partial(open_file, frames=args.max_frames, backend=backend)
    batches = [files[i : i + args.batch_size] for i in range(0, len(files), args.batch_size)]
    first_caption_s, wait_s, captions, videos, refused = None, 0.0, 0, 0, None
    with ThreadPoolExecutor(8) as pool, args.out.open("w") as out:
        loading = [pool.map(load, batches[0])] if batches else []
        for index, paths in enumerate(batches):
            if index + 1 < len(batches):
                loading.append(pool.map(load, batches[index + 1]))
            waited = time.perf_counter()
            items = list(loading[index])
            wait_s += time.perf_counter() - waited
            batch_texts = [texts["video" if is_video[path] else "image"] for path in paths]
            try:
                inputs = processor_inputs(processor, batch_texts, items, settings, frame_kwargs)
            except (TypeError, ValueError) as error:  # a processor that takes no `device`: its CPU path
                if settings.pop("device", None) is None:
                    raise
                refused = f"{type(error).__name__}: {error}"[:200]
                inputs = processor_inputs(processor, batch_texts, items, settings, frame_kwargs)
            timing = inputs.get("second_per_grid_ts")  # seconds a frame pair spans: fp32 (bf16 reads 1.667 as 1.664)
            inputs = inputs.to("cuda", dtype=torch.bfloat16)  # pixels as the model's weights (DeepSeek-OCR casts none)
            if timing is not None:
                inputs["second_per_grid_ts"] = timing.to("cuda")
            with torch.inference_mode():
                generated = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
            new = generated[:, inputs["input_ids"].shape[1] :]
            for path, caption in zip(paths, processor.batch_decode(new, skip_special_tokens=True)):
                out.write(json.dumps({"path": str(path), "caption": caption}) + "\n")
            captions += len(paths)
            videos += sum(is_video[path] for path in paths)
            if first_caption_s is None:
                first_caption_s = time.perf_counter() - loaded
    ended = time.perf_counter()
    print(json.dumps({
        "images": captions,  # items captioned, videos included (the key bench_cli.py reads)
        "videos": videos,
        "batch_size": args.batch_size,
        "max_frames": args.max_frames,
        "max_frame_tokens": args.max_frame_tokens,
        "video_backend": backend if videos else None,
        "wall_s": ended - STARTED,
        "load_s": loaded - STARTED,
        "loop_s": ended - loaded,
        "first_caption_after_load_s": first_caption_s,
        "input_wait_s": wait_s,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(),
        "settings": {**resolution, **settings, **({"videos_kwargs": frame_kwargs} if frame_kwargs else {})},
        "device_refused": refused,
    }))


if __name__ == "__main__":
    main()
