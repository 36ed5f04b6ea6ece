"""`encoder-graphs caption PATH...`: caption image and video folders into a resumable JSONL file,
and optionally caption files beside each image.

Exit status: 0 every file has a caption, 1 some files failed, 2 usage error, 3 an output could
not be written during the run, 130 interrupted.
`--help` and the usage errors that need no model answer before torch or transformers is imported.
"""

import argparse
import math
import sys
import textwrap
from pathlib import Path

from encoder_graphs.app.config import (
    COMPILE_FROM_FILES,
    DEFAULT_FRAME_TOKENS,
    DEFAULT_IMAGE_TOKENS,
    DEFAULT_PROMPT,
    NVDEC_FROM_VIDEOS,
    PROMPT_FIELDS,
)
from encoder_graphs.app.errors import EXIT_INTERRUPTED, EXIT_OUTPUT, EXIT_USAGE, OutputError, UsageError, printable
from encoder_graphs.presets.names import PRESET_NAMES


def build_parser() -> argparse.ArgumentParser:
    from encoder_graphs import __version__

    description = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, as one line
    parser = argparse.ArgumentParser(prog="encoder-graphs", description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    caption = commands.add_parser(
        "caption", help="caption images and videos into a JSONL file", formatter_class=_WholeNamesFormatter
    )
    caption.add_argument(
        "paths", nargs="*", metavar="PATH",
        help="image/video files or folders (recursive); or dataset shards: WebDataset .tar files, .parquet files or a "
        "folder saved with datasets' save_to_disk (globs and brace lists such as 'shards/{00000..00127}.tar'), "
        "each captioned into an output shard of the same name in --out DIR",
    )
    caption.add_argument(
        "--samples",
        action="store_true",
        help="also caption the bundled sample images (alone and without --out: a demo, its captions printed and "
        "nothing kept)",
    )
    caption.add_argument(
        "--manifest", type=Path, default=None, metavar="FILE",
        help="also caption the files this list names: CSV with a path column (path, file_name, filename or file), "
        "JSON lines, or a path a line; relative paths from its folder; a listed file that is missing is an error "
        "record",
    )
    group = caption.add_argument_group("dataset shards")
    group.add_argument("--image-column", default=None, metavar="NAME",
                       help="the column of image (or video) bytes, HF image structs or paths (default: the first of "
                       "image, jpg, jpeg, png, webp, img, video, mp4, webm)")
    group.add_argument("--key-column", default=None, metavar="NAME",
                       help="the column naming each row (default: key, __key__ or id; else the row's number)")
    group.add_argument("--out-format", default="jsonl", choices=("jsonl", "parquet"),
                       help="the output shards' format (default: %(default)s)")
    group.add_argument("--webdataset-copy", action="store_true",
                       help="with .tar shards, also write each as <shard name>.tar into --out: its members with "
                       "each sample's caption added (<key>.caption.txt, <key>.caption.<NAME>.txt with named prompts) "
                       "and its record (<key>.caption.json)")
    _model_arguments(caption)
    _text_arguments(caption)
    _output_arguments(caption)
    _performance_arguments(caption)
    return parser


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default=None,
        help="a local checkpoint directory; a Hugging Face Hub id (owner/name), taken from the Hugging Face "
        "cache (offline) or downloaded into it; or a preset (random weights: speed tests, noise captions): "
        f"{', '.join(PRESET_NAMES)}; default: the embedded tiny model (random weights too)",
    )
    group.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available (default)"
    )
    group.add_argument(
        "--max-image-tokens",
        type=_tokens_or_model,
        default=DEFAULT_IMAGE_TOKENS,
        metavar="N|model",
        help="resolution for models that size their grid to the image: larger images and video frames are shrunk "
        "to at most N vision tokens; 'model' keeps the checkpoint's own limit"
        f"{_families_say('max_image_tokens')} (default: %(default)s)",
    )
    group.add_argument(
        "--max-tiles",
        type=_positive_int,
        default=None,
        help=f"resolution for tiling models: at most N tiles per image{_families_say('max_tiles')}",
    )
    group.add_argument(
        "--max-frame-tokens",
        type=_tokens_or_model,
        default=DEFAULT_FRAME_TOKENS,
        metavar="N|model",
        help="video resolution for models that size their grid to the frame: each frame is shrunk to at most N "
        "vision tokens a pair of frames; 'model' keeps the checkpoint's own"
        f"{_families_say('max_frame_tokens')} (default: %(default)s)",
    )
    group.add_argument(
        "--max-frames", type=_even_int, default=16,
        help="frames sampled from each video, evenly over its length, an even number (default: %(default)s)",
    )
    group.add_argument(
        "--video-fps", type=_positive_float, default=None, metavar="F",
        help=f"sample F frames a second of each video instead, up to --max-frames{_families_say('video_fps')}",
    )
    group.add_argument(
        "--video-sampling", choices=("exact", "keyframes"), default="exact",
        help="exact: the frame shown at each sampled time, as the model's video processor takes it; keyframes: the "
        "keyframe nearest each time where one lies within half the interval between times, which decodes without "
        "the frames before it (faster, frames up to half an interval off) (default: %(default)s)",
    )
    group.add_argument(
        "--video-decoder", choices=("auto", "cpu", "nvdec"), default="auto",
        help="cpu: FFmpeg on the decoder processes' cores; nvdec: the GPU's video decoder takes H.264 and HEVC "
        "(needs the nvdec extra, PyNvVideoCodec; the same frames, bit for bit; other clips stay on the CPU); auto: "
        f"nvdec where it can run and the job has at least {NVDEC_FROM_VIDEOS} videos per GPU (below that its "
        "slower start costs more than it saves), else cpu (default: %(default)s)",
    )
    group.add_argument(
        "--video-timeout", type=_positive_float, default=120.0, metavar="SECONDS",
        help="a video whose frames take longer to decode becomes an error record (default: %(default)s)",
    )


def _text_arguments(parser: argparse.ArgumentParser) -> None:
    fields = ", ".join("{" + f + "}" for f in PROMPT_FIELDS)
    group = parser.add_argument_group("prompt and caption text")
    prompt = group.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt", action="append", default=None, metavar="[NAME=]TEXT",
        help=f"the instruction given with each file; may use {fields} "
        f"(default: {DEFAULT_PROMPT!r}, or the model's own{_families_say('prompt')}). Repeat as "
        "NAME=TEXT for several captions per file in one pass (the image encoded and prefilled once): each record "
        "then holds captions: {NAME: caption}, and its caption, text, sidecar and metadata row are the first "
        "prompt's",
    )
    prompt.add_argument(
        "--prompt-file", type=Path, default=None,
        help="read the prompt (template) from this file; a .json file: an object of NAME: prompt, as repeated "
        "--prompt NAME=TEXT",
    )
    group.add_argument("--prefix", default="", help="text put before each caption (trigger words), e.g. 'photo of sks, '")
    group.add_argument("--suffix", default="", help="text put after each caption")
    group.add_argument(
        "--max-new-tokens", type=_positive_int, default=32, help="caption length limit (default: %(default)s)"
    )
    group.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, help="above 0: sample (default: 0, greedy)"
    )
    group.add_argument(
        "--top-p", type=_probability, default=None, help="with --temperature: nucleus sampling (default: 1.0, off)"
    )
    group.add_argument(
        "--seed",
        type=int,
        default=None,
        help="with --temperature: a file's caption then depends on the seed and its path within its folder "
        "only, not on its batch: a resumed run samples as an uninterrupted one",
    )


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("outputs")
    group.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSONL record, one line per file; a rerun skips the files already in it, also where their folder "
        "moved (default: captions.jsonl)",
    )
    group.add_argument("--sidecar", action="store_true", help="also write each caption to <file>.txt beside the file")
    group.add_argument("--sidecar-ext", default=None, help="with --sidecar: the sidecars' extension (default: .txt)")
    group.add_argument("--overwrite", action="store_true", help="with --sidecar: caption files whose sidecar exists")
    group.add_argument(
        "--hf-metadata", action="store_true", help="also write metadata.jsonl (file_name, text) in each folder given"
    )
    group.add_argument("--retry-failed", action="store_true",
                       help="try again the files (or dataset shards' samples) whose latest record is an error")
    group.add_argument(
        "--redo", action="store_true",
        help="caption every file again, also those --out holds (the latest record of a file wins); needed to "
        "write captions of other settings (--model, --prompt, --max-new-tokens, resolution, sampling) into an --out "
        "that holds some",
    )
    group.add_argument(
        "--limit", type=_positive_int, default=None, metavar="N",
        help="caption at most N files this run (of those not yet done, in path order); a rerun takes the next N",
    )
    group.add_argument(
        "--dry-run", action="store_true",
        help="say what a run would do (the files found, done and to do, the settings, the outputs) and stop: "
        "no model loads, nothing is written",
    )
    group.add_argument("--include-hidden", action="store_true", help="also caption hidden files and folders")
    group.add_argument(
        "--no-follow-links",
        action="store_true",
        help="skip symlinks found in the folders, so the run stays inside the PATHs given (links given as PATH "
        "are used); by default links are followed, except into /proc, /sys and /dev",
    )
    group.add_argument("--stats-json", type=Path, default=None, help="also write the statistics as JSON")
    group.add_argument("--quiet", action="store_true", help="no progress bar")


def _performance_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("performance")
    group.add_argument(
        "--batch-size",
        type=_batch_size,
        default=None,
        help="files in one generate call, at most what the GPU memory left holds; auto: that most, up to 64 "
        "(default: auto)",
    )
    group.add_argument(
        "--max-batch-tokens",
        type=_positive_int,
        default=None,
        help="vision tokens in one generate call (default: what a batch of the longest prompts holds, the batch "
        "size x the longest prompt)",
    )
    group.add_argument("--budgets", type=_budgets, default=None, help="encoder token budgets, e.g. 1024,4096")
    group.add_argument(
        "--attn-backend", default=None, help="varlen attention backend of the encoder graphs: torch, flash_attn, "
        "flashinfer or sdpa (default: per model and device)"
    )
    group.add_argument("--no-graphs", action="store_true", help="run the encoder and the decoder eagerly (no CUDA graphs)")
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile, before the capture, the encoder's blocks, the language model's MLPs and norms and "
        "the decode step's layers: a start tens of seconds longer (less with inductor's cache warm), a slightly "
        f"faster loop (default: on a GPU with at least {COMPILE_FROM_FILES:,} files to caption per GPU)",
    )
    group = parser.add_argument_group("across machines")
    group.add_argument(
        "--num-shards", type=_positive_int, default=None, metavar="N",
        help="split the files into N disjoint shards by their paths within the folders given (the same on every "
        "machine, wherever the dataset is mounted); this process captions one, --shard-index (default: "
        "a Slurm job array's SLURM_ARRAY_TASK_COUNT and task, when set); --out may say {shard}, else each "
        "shard writes <out stem>.shard-I-of-N<suffix>",
    )
    group.add_argument("--shard-index", type=int, default=None, metavar="I", help="with --num-shards: 0 to N-1")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: 0 for --help and --version, 2 for bad flags
        return int(exit_.code or 0)
    from encoder_graphs.app.command import RESUME_HINT, caption
    from encoder_graphs.app.datasets import is_dataset_run
    from encoder_graphs.app.settings import Settings

    try:
        settings = Settings.from_arguments(args)
        if is_dataset_run(settings):
            from encoder_graphs.app.dataset_run import caption_datasets

            return caption_datasets(settings)
        return caption(settings)
    except UsageError as error:
        print(f"encoder-graphs: error: {printable(str(error))}", file=sys.stderr)
        return EXIT_USAGE
    except OutputError as error:  # what was written before stays whole
        print(f"encoder-graphs: error: {error}; {RESUME_HINT} once it can be written", file=sys.stderr)
        return EXIT_OUTPUT
    except KeyboardInterrupt:
        print(f"\nencoder-graphs: interrupted; {RESUME_HINT}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _families_say(option: str) -> str:
    """What the model families say of `option` (their help hooks, `models/<family>/help.py`), in
    parentheses; "" where none says anything. The parser is built before any model is chosen."""
    from encoder_graphs.models.registry import option_help

    phrases = option_help(option)
    return f" ({'; '.join(phrases)})" if phrases else ""


class _WholeNamesFormatter(argparse.HelpFormatter):
    """Help lines broken at spaces only: a preset's name (tiny-internvl) stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _even_int(text: str) -> int:
    value = _positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"expected an even number, got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def _probability(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number above 0 and at most 1, got {text!r}")
    return value


def _tokens_or_model(text: str) -> int | None:
    """A positive integer, or None for 'model' (the checkpoint's own limit)."""
    return None if text == "model" else _positive_int(text)


def _batch_size(text: str) -> int | None:
    """A positive integer, or None for auto."""
    return None if text == "auto" else _positive_int(text)


def _budgets(text: str) -> list[int]:
    try:
        budgets = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not budgets or budgets[0] < 1:
        raise argparse.ArgumentTypeError(f"budgets must be positive integers, got {text!r}")
    return budgets
