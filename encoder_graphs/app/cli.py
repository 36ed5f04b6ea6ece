"""`encoder-graphs caption PATH...`: caption image and video folders into a resumable JSONL file.

Exit status: 0 all files captioned, 1 some files failed, 2 usage error. `--help` and the usage
errors that need no model answer before torch or transformers is imported.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_graphs.app.config import DEFAULT_PROMPT, CaptionConfig

if TYPE_CHECKING:  # the heavy imports wait until a command needs them
    import torch
    from transformers import PreTrainedModel

    from encoder_graphs.app.media import MediaFile
    from encoder_graphs.app.results import ResultsFile
    from encoder_graphs.protocols import CaptionInputs

EXIT_OK, EXIT_FAILURES, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encoder-graphs", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    caption = commands.add_parser("caption", help="caption images and videos into a JSONL file")
    caption.add_argument("paths", nargs="*", metavar="PATH", help="image/video files or folders (recursive)")
    caption.add_argument("--samples", action="store_true", help="also caption the bundled sample images")
    caption.add_argument(
        "--model",
        default=None,
        help="a local checkpoint directory or a preset name; default: the embedded tiny model "
        "(random weights: its captions are noise)",
    )
    caption.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help="the instruction given with each file (default: %(default)r)"
    )
    caption.add_argument(
        "--max-new-tokens", type=_positive_int, default=32, help="caption length limit (default: %(default)s)"
    )
    caption.add_argument(
        "--batch-size", type=_positive_int, default=8, help="files in one generate call (default: %(default)s)"
    )
    caption.add_argument(
        "--max-batch-tokens",
        type=_positive_int,
        default=16384,
        help="vision tokens in one generate call (default: %(default)s)",
    )
    caption.add_argument(
        "--max-frames", type=_even_int, default=16, help="frames sampled per video, even (default: %(default)s)"
    )
    caption.add_argument(
        "--max-tiles",
        type=_positive_int,
        default=None,
        help="tiles per image for tiling models (InternVL; default: the checkpoint's); others ignore it",
    )
    caption.add_argument(
        "--out",
        type=Path,
        default=Path("captions.jsonl"),
        help="JSONL results, one line per file; a rerun skips the files already in it (default: %(default)s)",
    )
    caption.add_argument("--budgets", type=_budgets, default=None, help="encoder token budgets, e.g. 1024,4096")
    caption.add_argument("--attn-backend", default=None, help="varlen attention backend of the encoder graphs")
    caption.add_argument(
        "--no-graphs", action="store_true", help="run the encoder and the decoder eagerly (no CUDA graphs)"
    )
    caption.add_argument("--stats-json", type=Path, default=None, help="also write the statistics as JSON")
    caption.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available (default)"
    )
    caption.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: 0 for --help, 2 for bad flags
        return int(exit_.code or 0)
    try:
        return caption(args)
    except UsageError as error:
        print(f"encoder-graphs: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def caption(args: argparse.Namespace) -> int:
    """Check the request, load the model, caption what is not done yet, report."""
    files, config, results = _plan(args)
    todo = sum(not results.is_done(f.path) for f in files)
    if not todo:
        failed = sum(results.is_failed(f.path) for f in files)
        print(f"nothing to do: all {len(files)} files are already in {args.out} ({failed} of them as errors)")
        return _exit_status(results, files)
    device = _device(args.device)
    model, inputs = load_model(args.model, device, max_tiles=args.max_tiles)
    summary, graph_stats, graph_table = _run(args, model, inputs, config, files, results, todo)
    from encoder_graphs.report import format_run_stats

    print(format_run_stats(summary))
    print(graph_table)
    if args.stats_json is not None:
        payload = {"pipeline": summary, **graph_stats, "model": args.model or "default", "device": str(device)}
        args.stats_json.parent.mkdir(parents=True, exist_ok=True)
        args.stats_json.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return _exit_status(results, files)


def _plan(args: argparse.Namespace) -> "tuple[list[MediaFile], CaptionConfig, ResultsFile]":
    """The files, the settings and the results file: every usage error that needs no model."""
    from encoder_graphs.app.media import SAMPLES_DIR, discover
    from encoder_graphs.app.results import ResultsFile

    paths = args.paths + ([SAMPLES_DIR] if args.samples else [])
    if not paths:
        raise UsageError("give at least one PATH (or --samples)")
    try:
        files = discover(paths)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error
    if not files:
        raise UsageError(f"no images or videos found under {' '.join(map(str, paths))}")
    try:
        config = CaptionConfig(
            prompt=args.prompt,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            max_batch_tokens=args.max_batch_tokens,
        )
        results = ResultsFile(args.out)
    except ValueError as error:
        raise UsageError(str(error)) from error
    except OSError as error:
        raise UsageError(f"cannot use --out {args.out}: {error}") from error
    if results.repaired_bytes:
        print(
            f"encoder-graphs: dropped a half-written last line ({results.repaired_bytes} bytes) of {args.out}",
            file=sys.stderr,
        )
    return files, config, results


def _device(name: str) -> "torch.device":
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but CUDA is not available")
    return torch.device(name)


def _run(
    args: argparse.Namespace,
    model: "PreTrainedModel",
    inputs: "CaptionInputs",
    config: CaptionConfig,
    files: "list[MediaFile]",
    results: "ResultsFile",
    todo: int,
) -> tuple[dict, dict, str]:
    """Enable the graphs, caption, disable them: the run's and the graphs' statistics."""
    from encoder_graphs import enable_cuda_graphs
    from encoder_graphs.app.media import LoadLimits
    from encoder_graphs.app.pipeline import Captioner, Progress, longest_sequence

    limits = LoadLimits(
        max_frames=args.max_frames,
        min_side=inputs.min_side,
        max_pixels=inputs.max_image_pixels,
        frame_max_pixels=inputs.max_frame_pixels,
    )
    try:
        handle = enable_cuda_graphs(
            model,
            budgets=args.budgets,
            attn_backend=args.attn_backend,
            enabled=not args.no_graphs,
            decoder_max_batch_size=config.batch_size,
            decoder_max_cache_len=longest_sequence(inputs, config, limits),
        )
    except ValueError as error:  # an architecture without an adapter, a bad backend or budgets
        raise UsageError(f"cannot enable graphs on this model: {error}") from error
    try:
        progress = None if args.quiet else Progress(todo)
        run_stats = Captioner(model, inputs, config, limits).run(files, results, progress)
    finally:
        graph_stats, graph_table = handle.stats(), handle.format_stats()
        handle.disable()
    return run_stats.as_dict(), graph_stats, graph_table


def _exit_status(results: "ResultsFile", files: "list[MediaFile]") -> int:
    # Failures recorded by an earlier, interrupted run of the same files count too.
    return EXIT_FAILURES if any(results.is_failed(f.path) for f in files) else EXIT_OK


def load_model(
    name: str | None, device: "torch.device", *, max_tiles: int | None = None
) -> "tuple[PreTrainedModel, CaptionInputs]":
    """(model, inputs) for a checkpoint directory, a preset name, or the embedded default."""
    import torch
    from transformers.utils import logging as hf_logging

    from encoder_graphs.models.presets import PRESETS

    hf_logging.disable_progress_bar()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if name is not None and name in PRESETS and not Path(name).exists():
        return _load_preset(name, dtype, device, max_tiles)
    from encoder_graphs.models.default_model import default_model_dir

    directory = default_model_dir() if name is None else Path(name)
    if not (directory / "config.json").is_file():
        raise UsageError(
            f"--model {name}: neither a checkpoint directory (no config.json) nor a preset "
            f"({', '.join(sorted(PRESETS))})"
        )
    return _load_checkpoint(directory, dtype, device, max_tiles)


def _load_checkpoint(
    directory: Path, dtype: "torch.dtype", device: "torch.device", max_tiles: int | None
) -> "tuple[PreTrainedModel, CaptionInputs]":
    from transformers import AutoConfig, AutoModelForImageTextToText

    from encoder_graphs.models.registry import family_for_config

    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        inputs = family_for_config(config).inputs.from_pretrained(directory, max_tiles=max_tiles)
        inputs.check_model(config)  # before loading: a large checkpoint takes GBs
        model = AutoModelForImageTextToText.from_pretrained(
            directory, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the model from {directory}: {error}") from error
    return model.to(device).eval(), inputs


def _load_preset(
    name: str, dtype: "torch.dtype", device: "torch.device", max_tiles: int | None
) -> "tuple[PreTrainedModel, CaptionInputs]":
    """A random-weight preset with the embedded tiny model's tokenizer, when that tokenizer fits it."""
    from encoder_graphs.models.presets import PRESETS, build_model

    inputs = _embedded_inputs(name, max_tiles)
    if inputs is None:
        fitting = [preset for preset in sorted(PRESETS) if _embedded_inputs(preset, max_tiles) is not None]
        raise UsageError(
            f"preset {name} has random weights and no tokenizer, and the embedded tiny tokenizer does "
            f"not fit it; use a checkpoint directory or one of {', '.join(fitting)}"
        )
    return build_model(name, dtype=dtype, device=device), inputs


def _embedded_inputs(preset: str, max_tiles: int | None) -> "CaptionInputs | None":
    """The embedded tiny model's tokenizer and processor, when they fit `preset` (checked before
    building: a large preset takes GBs)."""
    from encoder_graphs.models.default_model import PRESET, default_model_dir
    from encoder_graphs.models.presets import get_config
    from encoder_graphs.models.registry import family_for_config

    config = get_config(preset)
    family = family_for_config(config)
    if family.inputs is not family_for_config(get_config(PRESET)).inputs:
        return None
    inputs = family.inputs.from_pretrained(default_model_dir(), max_tiles=max_tiles)
    try:
        inputs.check_model(config)
    except ValueError:
        return None
    return inputs


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _even_int(text: str) -> int:
    value = _positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even, got {value}")
    return value


def _budgets(text: str) -> list[int]:
    try:
        budgets = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not budgets or budgets[0] < 1:
        raise argparse.ArgumentTypeError(f"budgets must be positive integers, got {text!r}")
    return budgets
