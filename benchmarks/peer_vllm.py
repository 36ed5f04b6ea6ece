"""The peer a dataset builder would pick instead of encoder-graphs: vLLM's offline `LLM.generate`
with images, over the same files as the caption command, at the same resolution cap (Qwen's
`max_pixels`, as the caption command's default --max-image-tokens), the same prompt and the same
number of new tokens, greedy. Prints one JSON line of timings in the keys `stock_caption.py`
prints, so `bench_cli.py --runs vllm` reports it beside ours and the stock script.

vLLM reads a checkpoint from disk: `--write-checkpoint` writes the preset's (its config, tokenizer,
chat template and processor files, and random bf16 weights; the same model ours builds) once,
untimed, where `--checkpoint` says. The timed run then imports vLLM, starts its engine (its
torch.compile and CUDA graphs: a first start on a machine fills `~/.cache/vllm`, a second reuses
it, and the report gives both) and captions every file. Random weights never write an end of
text: `ignore_eos` makes every caption `--new-tokens` long, as ours and the stock script's are.

Photos are read on threads, turned upright by their EXIF orientation and shrunk to at most
`max_pixels` as they are decoded (a JPEG inside its decoder, as the caption command does; the
processor would shrink them there anyway), in chunks of `--chunk` files per `generate` call, so
1,024 12 MP photos never sit in memory at once; vLLM schedules each chunk's requests together.
The first caption's time is the first chunk's end (vLLM returns a call's outputs together).
    python3 benchmarks/peer_vllm.py --write-checkpoint --checkpoint DIR [--preset qwen2.5-vl-3b]
    python3 benchmarks/peer_vllm.py FOLDER --checkpoint DIR --out out.jsonl [--new-tokens 32]
"""

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

from PIL import Image, ImageOps  # noqa: E402

EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp"}


def write_checkpoint(preset: str, directory: Path) -> None:
    """The preset's files and random bf16 weights, as a checkpoint folder vLLM loads."""
    import shutil

    import torch

    from encoder_graphs.presets import build_model
    from encoder_graphs.presets.files import preset_files_dir

    shutil.copytree(preset_files_dir(preset), directory, dirs_exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 3.8 B parameters: seconds there
    build_model(preset, dtype=torch.bfloat16, device=device).save_pretrained(directory)


def open_image(path: Path, max_pixels: int) -> Image.Image:
    """Upright RGB of at most `max_pixels` pixels (a JPEG reduced inside its decoder first)."""
    with Image.open(path) as image:
        scale = math.sqrt(max_pixels / (image.width * image.height))
        if scale < 1:
            image.draft("RGB", (max(1, int(image.width * scale)), max(1, int(image.height * scale))))
        upright = ImageOps.exif_transpose(image).convert("RGB")
    scale = math.sqrt(max_pixels / (upright.width * upright.height))
    if scale < 1:
        upright = upright.resize((max(1, int(upright.width * scale)), max(1, int(upright.height * scale))),
                                 Image.Resampling.BICUBIC)
    return upright


def chat_prompt(checkpoint: Path, prompt: str) -> str:
    """The prompt around one image, as the checkpoint's chat template writes it (the tokenizer's
    and the processor's are one file, `chat_template.jinja`; the tokenizer needs no torchvision)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
        add_generation_prompt=True, tokenize=False,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, nargs="?")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--write-checkpoint", action="store_true", help="write --checkpoint from --preset and exit")
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--max-image-tokens", type=int, default=1280, help="Qwen: max_pixels = this x 28 x 28")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", default=None, help="default: the caption command's")
    parser.add_argument("--chunk", type=int, default=256, help="files per LLM.generate call")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs (a slower vLLM)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not args.write_checkpoint and (args.folder is None or args.out is None):
        parser.error("give FOLDER and --out (or --write-checkpoint)")
    return args


def main() -> None:
    args = parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.preset, args.checkpoint)
        return
    from encoder_graphs.app.config import DEFAULT_PROMPT

    files = sorted(p for p in args.folder.rglob("*") if p.suffix.lower() in EXTENSIONS)
    max_pixels = args.max_image_tokens * 28 * 28
    text = chat_prompt(args.checkpoint, args.prompt or DEFAULT_PROMPT)
    imported = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - imported
    llm = LLM(
        model=str(args.checkpoint), dtype="bfloat16", max_model_len=args.max_model_len, seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        limit_mm_per_prompt={"image": 1, "video": 0}, mm_processor_kwargs={"max_pixels": max_pixels},
    )
    loaded = time.perf_counter()
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    chunks = [files[i : i + args.chunk] for i in range(0, len(files), args.chunk)]
    first_caption_s, wait_s, captions, generated = None, 0.0, 0, 0
    with ThreadPoolExecutor(8) as pool, args.out.open("w") as out:
        coming = pool.map(lambda p: open_image(p, max_pixels), chunks[0]) if chunks else None
        for index, paths in enumerate(chunks):
            waited = time.perf_counter()
            images = list(coming)
            wait_s += time.perf_counter() - waited
            if index + 1 < len(chunks):  # the next chunk's files decode while this one runs
                coming = pool.map(lambda p: open_image(p, max_pixels), chunks[index + 1])
            requests = [{"prompt": text, "multi_modal_data": {"image": image}} for image in images]
            outputs = llm.generate(requests, sampling, use_tqdm=False)
            for path, output in zip(paths, outputs):
                completion = output.outputs[0]
                out.write(json.dumps({"path": str(path), "caption": completion.text}) + "\n")
                generated += len(completion.token_ids)
            captions += len(paths)
            if first_caption_s is None:
                first_caption_s = time.perf_counter() - loaded
    ended = time.perf_counter()
    import torch

    free, total = torch.cuda.mem_get_info()  # the engine runs in a process of its own: the device's use
    print(json.dumps({
        "images": captions,
        "videos": 0,
        "batch_size": args.chunk,  # vLLM batches within a call by itself
        "wall_s": ended - STARTED,
        "load_s": loaded - STARTED,
        "import_s": import_s,
        "engine_start_s": loaded - imported - import_s,
        "loop_s": ended - loaded,
        "first_caption_after_load_s": first_caption_s,
        "input_wait_s": wait_s,
        "generated_tokens": generated,
        # In use on the device at the end (vLLM reserves --gpu-memory-utilization of the card for
        # its cache by design): not comparable to the others' peaks, which are their own.
        "peak_gpu_memory_bytes": total - free,
        "gpu_memory_is_card_use": True,
        "settings": {"max_pixels": max_pixels, "max_model_len": args.max_model_len, "enforce_eager": args.enforce_eager,
                     "gpu_memory_utilization": args.gpu_memory_utilization, "vllm": vllm.__version__},
        "device_refused": None,
    }))


if __name__ == "__main__":
    main()
