"""Loading the model and its caption inputs: a checkpoint directory, a Hub id in the Hugging Face
cache, a preset (random weights, the embedded tokenizer where it fits), or the embedded tiny
default; and the device."""

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from encoder_graphs.app.errors import UsageError
from encoder_graphs.presets.names import PRESET_NAMES

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

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


@dataclass(frozen=True)
class ModelSource:
    """A model to load: its config and caption inputs, read first (they take seconds at most), so
    that the request is checked against them before the weights (GBs) load. `preset`: a preset's
    name, else None and `directory` holds the checkpoint."""

    config: "PretrainedConfig"
    inputs: "CaptionInputs"
    directory: Path | None = None
    preset: str | None = None


def open_model(
    name: str | None,
    *,
    max_tiles: int | None = None,
    max_image_tokens: int | None = None,
    max_frame_tokens: int | None = None,
) -> ModelSource:
    """The config and inputs of a checkpoint directory, a preset name, or the embedded default; the
    inputs follow the resolution policy (`max_tiles`, `max_image_tokens`, `max_frame_tokens`:
    `from_pretrained`'s)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from encoder_graphs.models.registry import family_for_config
    from encoder_graphs.presets.files import preset_files_dir

    hf_logging.disable_progress_bar()
    resolution = {"max_tiles": max_tiles, "max_image_tokens": max_image_tokens, "max_frame_tokens": max_frame_tokens}
    if name is not None and name in PRESET_NAMES and not Path(name).exists():
        from encoder_graphs.presets import get_config

        config = get_config(name)
        try:
            files = preset_files_dir(name)
        except OSError as error:
            raise cache_error(error) from error
        try:
            inputs = family_for_config(config).inputs.from_pretrained(files, **resolution)
        except ValueError as error:  # a resolution policy the family's processor refuses (--max-tiles)
            raise resolution_error(error) or UsageError(f"--model {name}: {error}") from error
        inputs.check_model(config)
        return ModelSource(config, inputs, preset=name)
    from encoder_graphs.presets.default_model import default_model_dir

    try:
        directory = default_model_dir() if name is None else hub_checkpoint(name) or Path(name)
    except OSError as error:
        raise cache_error(error) from error
    if not (directory / "config.json").is_file():
        raise UsageError(
            f"--model {name}: neither a checkpoint directory (no config.json), a Hugging Face Hub id "
            f"(owner/name) nor a preset ({', '.join(PRESET_NAMES)})"
        )
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        inputs = family_for_config(config).inputs.from_pretrained(directory, **resolution)
        inputs.check_model(config)
    except (OSError, ValueError) as error:
        raise resolution_error(error) or UsageError(f"cannot load the model from {directory}: {error}") from error
    return ModelSource(config, inputs, directory=directory)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# A checkpoint's files: no code (trust_remote_code stays off), no other formats' weights.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def hub_checkpoint(name: str) -> Path | None:
    """The folder of `name`, a Hub id (owner/name) that is no local path, in the Hugging Face cache
    (`HF_HOME`, `HF_HUB_CACHE`): taken from the cache when it holds the checkpoint, so a run works
    offline; else downloaded there (unless `HF_HUB_OFFLINE=1`). None: `name` is no Hub id."""
    if not HUB_ID.fullmatch(name) or os.path.lexists(name):
        return None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return None  # not a Hub id: the caller says what --model may be
    try:
        return Path(snapshot_download(name, allow_patterns=HUB_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise UsageError(f"--model {name}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                             "HF_HUB_OFFLINE is set; download it first (hf download NAME) or give its folder") from None
    print(f"encoder-graphs: downloading {name} into the Hugging Face cache ({constants.HF_HUB_CACHE}) ...",
          file=sys.stderr)
    try:
        return Path(snapshot_download(name, allow_patterns=HUB_FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise UsageError(f"--model {name}: no such folder here, and cannot download it from the Hugging Face Hub "
                         f"({first}); give a local checkpoint folder, or fetch it where the Hub can be reached "
                         "(hf download NAME)") from error


def cache_error(error: OSError) -> UsageError:
    """The usage error of a cache folder the default model or a preset's files cannot be built in."""
    from encoder_graphs.presets.files import cache_root

    return UsageError(f"cannot build the model's files in the cache folder {cache_root()}: {error.strerror or error}; "
                      "set ENCODER_GRAPHS_CACHE to a folder you can write")


def resolution_error(error: Exception) -> UsageError | None:
    """A family's refusal of a resolution argument (its message starts with the argument's name)
    as the usage error of its flag; None for another error."""
    for name in ("max_tiles", "max_image_tokens", "max_frame_tokens"):
        if isinstance(error, ValueError) and str(error).startswith(name):
            return UsageError(f"--{name.replace('_', '-')}{str(error)[len(name):]}")
    return None


def load_model(source: ModelSource, device: "torch.device") -> "PreTrainedModel":
    """The weights of `source` on `device` (bfloat16 on CUDA, float32 on the CPU); a random-weight
    preset is built there."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForImageTextToText

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if source.preset is not None:
        from encoder_graphs.presets import build_model

        return build_model(source.preset, dtype=dtype, device=device)
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            source.directory, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
    except (OSError, ValueError, SafetensorError) as error:
        raise UsageError(f"cannot load the weights of {source.directory}: {error} (a damaged or partly copied file? "
                         "fetch the checkpoint again)") from error
    return model.to(device).eval()
