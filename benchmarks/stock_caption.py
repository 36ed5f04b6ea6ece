"""What a user writes without encoder-graphs: the official processor and `model.generate`, in
batches of 8, over the same files at the same resolution policy, captions to JSONL. Given its
best plain settings: bf16, the fast (torchvision) processor running its resize on the GPU, files
decoded on threads one batch ahead, left padding, greedy. Prints one JSON line of timings.
    python3 benchmarks/stock_caption.py FOLDER --preset qwen2.5-vl-3b [--max-image-tokens 1280] --out out.jsonl
DeepSeek-OCR (no chat template): "<image>\n" + the prompt, "Free OCR." unless given, as its model card.
"""

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from PIL import Image, ImageOps  # noqa: E402
from transformers import AutoProcessor  # noqa: E402

from encoder_graphs.app.config import DEFAULT_PROMPT  # noqa: E402
from encoder_graphs.models.presets import build_model  # noqa: E402
from encoder_graphs.models.presets.files import preset_files_dir  # noqa: E402
from encoder_graphs.models.registry import family_for_config  # noqa: E402

EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp"}


def open_image(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--max-image-tokens", type=int, default=1280, help="Qwen: max_pixels = this x (patch x merge)^2")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", default=None, help="default: the caption command's for this model")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    files = sorted(p for p in args.folder.rglob("*") if p.suffix.lower() in EXTENSIONS)
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
    if processor.chat_template is None:  # DeepSeek-OCR: plain text after the image, as its model card writes it
        text = f"{processor.image_token}\n{prompt}"
    else:
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
            add_generation_prompt=True, tokenize=False,
        )
    batches = [files[i : i + args.batch_size] for i in range(0, len(files), args.batch_size)]
    first_caption_s, wait_s, captions, refused = None, 0.0, 0, None
    with ThreadPoolExecutor(8) as pool, args.out.open("w") as out:
        loading = [pool.map(open_image, batches[0])] if batches else []
        for index, paths in enumerate(batches):
            if index + 1 < len(batches):
                loading.append(pool.map(open_image, batches[index + 1]))
            waited = time.perf_counter()
            images = list(loading[index])
            wait_s += time.perf_counter() - waited
            try:
                inputs = processor(text=[text] * len(images), images=images, padding=True, return_tensors="pt", **settings)
            except (TypeError, ValueError) as error:  # a processor that takes no `device`: its CPU path
                if settings.pop("device", None) is None:
                    raise
                refused = f"{type(error).__name__}: {error}"[:200]
                inputs = processor(text=[text] * len(images), images=images, padding=True, return_tensors="pt", **settings)
            inputs = inputs.to("cuda", dtype=torch.bfloat16)  # pixels as the model's weights (DeepSeek-OCR casts none)
            with torch.inference_mode():
                generated = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
            new = generated[:, inputs["input_ids"].shape[1] :]
            for path, caption in zip(paths, processor.batch_decode(new, skip_special_tokens=True)):
                out.write(json.dumps({"path": str(path), "caption": caption}) + "\n")
            captions += len(paths)
            if first_caption_s is None:
                first_caption_s = time.perf_counter() - loaded
    ended = time.perf_counter()
    print(json.dumps({
        "images": captions,
        "wall_s": ended - STARTED,
        "load_s": loaded - STARTED,
        "loop_s": ended - loaded,
        "first_caption_after_load_s": first_caption_s,
        "input_wait_s": wait_s,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(),
        "settings": {**resolution, **settings},
        "device_refused": refused,
    }))


if __name__ == "__main__":
    main()
