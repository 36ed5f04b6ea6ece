"""Loading the model and its caption inputs: a checkpoint directory, a preset (random weights,
the embedded tokenizer where it fits), or the embedded tiny default; and the device."""

from pathlib import Path
from typing import TYPE_CHECKING

from encoder_graphs.app.errors import UsageError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from encoder_graphs.protocols import CaptionInputs


def pick_device(name: str, local_rank: int = 0) -> "torch.device":
    """`--device`; CUDA is the GPU of this torchrun rank (`LOCAL_RANK`)."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but CUDA is not available")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def load_model(
    name: str | None, device: "torch.device", *, max_tiles: int | None = None, max_image_tokens: int | None = None
) -> "tuple[PreTrainedModel, CaptionInputs]":
    """(model, inputs) for a checkpoint directory, a preset name, or the embedded default; the
    inputs follow the resolution policy (`max_tiles`, `max_image_tokens`: `from_pretrained`'s)."""
    import torch
    from transformers.utils import logging as hf_logging

    from encoder_graphs.models.presets import PRESETS

    hf_logging.disable_progress_bar()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    resolution = {"max_tiles": max_tiles, "max_image_tokens": max_image_tokens}
    if name is not None and name in PRESETS and not Path(name).exists():
        return _load_preset(name, dtype, device, resolution)
    from encoder_graphs.models.default_model import default_model_dir

    directory = default_model_dir() if name is None else Path(name)
    if not (directory / "config.json").is_file():
        raise UsageError(
            f"--model {name}: neither a checkpoint directory (no config.json) nor a preset "
            f"({', '.join(sorted(PRESETS))})"
        )
    return _load_checkpoint(directory, dtype, device, resolution)


def _load_checkpoint(
    directory: Path, dtype: "torch.dtype", device: "torch.device", resolution: dict
) -> "tuple[PreTrainedModel, CaptionInputs]":
    from transformers import AutoConfig, AutoModelForImageTextToText

    from encoder_graphs.models.registry import family_for_config

    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        inputs = family_for_config(config).inputs.from_pretrained(directory, **resolution)
        inputs.check_model(config)  # before loading: a large checkpoint takes GBs
        model = AutoModelForImageTextToText.from_pretrained(
            directory, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the model from {directory}: {error}") from error
    return model.to(device).eval(), inputs


def _load_preset(
    name: str, dtype: "torch.dtype", device: "torch.device", resolution: dict
) -> "tuple[PreTrainedModel, CaptionInputs]":
    """A random-weight preset with its generated tokenizer and processor files (noise captions)."""
    from encoder_graphs.models.preset_files import preset_files_dir
    from encoder_graphs.models.presets import build_model, get_config
    from encoder_graphs.models.registry import family_for_config

    config = get_config(name)
    inputs = family_for_config(config).inputs.from_pretrained(preset_files_dir(name), **resolution)
    inputs.check_model(config)
    return build_model(name, dtype=dtype, device=device), inputs
