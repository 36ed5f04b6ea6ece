"""What the rest of the package needs from one model family, beyond graphing its encoder.

A family adapter in `models/` implements `ModelFamily` (and `SupportsEncoderCudaGraph`), and its
`CaptionInputs` builds prompts and pixels for the caption command. `enable_cuda_graphs`, the
decoder runner and the command line speak only these protocols: adding a family touches `models/`
(an adapter, an inputs builder, a registry entry, a preset) and nothing else.
"""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from encoder_graphs.rewrites import Rewrites


@runtime_checkable
class ModelFamily(Protocol):
    """How `enable_cuda_graphs` routes a stock model's feature methods through the encoder
    manager, and which inputs the decoder's prefill needs."""

    # The model methods that encode images or videos (patched on the instance, restored by disable()).
    feature_methods: tuple[str, ...]
    # The model inputs of `generate` besides input_ids and attention_mask that the decoder runner
    # hands to its prefill, the model's own forward, which consumes them whole (the decode steps
    # need none): images, videos and what their positions are computed from. A call with any
    # other input goes to the stock `generate`.
    generate_inputs: tuple[str, ...]

    def feature_inputs(self, method: str, arguments: dict[str, Any]) -> Any | None:
        """The manager's inputs for one call of `method` (`arguments` by the stock method's
        parameter names), or None when only the stock method can answer it (e.g. per-layer
        outputs asked for)."""
        ...

    def feature_output(self, method: str, items: list[torch.Tensor], arguments: dict[str, Any]) -> Any:
        """What the stock `method` returns for `arguments`, built from the manager's per-item outputs."""
        ...

    def align_weights(self, rewrites: "Rewrites") -> None:
        """Faster kernels over the same weights, exactly: weights reshaped (padded to aligned
        widths) or modules run as the cheaper op they equal (no-op where nothing applies); every
        change recorded on `rewrites` (`encoder_graphs/rewrites/`), whose undo gives the stock model back."""
        ...

    def repeated_blocks(self) -> list[torch.nn.Module]:
        """The encoder's repeated blocks (transformer layers), which `enable_cuda_graphs(...,
        compile=True)` compiles; none where compiled blocks measured slower. Varlen attention
        with a host-int max length must go through a backend the transformers seam registered
        (kept out of the compiled code); dense attention of one shape per item (InternViT's
        stock sdpa) may be compiled in."""
        ...

    @classmethod
    def check_decoder_inputs(cls, inputs: dict[str, Any]) -> None:
        """Warn (once a process) where a `generate` call's model inputs lack what the processors
        return and the stock model needs to place the images as they meant (Qwen-VL: the token
        types M-RoPE reads). The call still runs as the stock `generate` would run it."""
        ...

    # Hooks, with the neutral defaults of `FamilyDefaults`:
    # The row of the model's position ids [rows, batch, tokens] that holds plain text positions
    # beside its rotary rows, which the model reads the prompts' bounds from (the decoder's packed
    # prefill restarts it in each prompt); None: one row of positions, nothing beside them.
    text_position_row: int | None

    @classmethod
    def pixel_values_per_vision_token(cls, config: Any) -> int:
        """How many pixel values (channels x pixels) the model's encoder takes for one vision token
        of the prompt, for a model of `config`: `--batch-size auto` counts them, in the model's
        dtype, in a sequence's prefill memory."""
        ...


class FamilyDefaults:
    """The neutral defaults of `ModelFamily`'s hooks, for an adapter to inherit and override
    where its family differs."""

    text_position_row: int | None = None

    @classmethod
    def pixel_values_per_vision_token(cls, config: Any) -> int:
        """One patch of the vision config per token (a ViT that merges no patches)."""
        vision = config.vision_config
        side = vision.patch_size if isinstance(vision.patch_size, int) else max(vision.patch_size)
        return getattr(vision, "num_channels", 3) * side * side


class EncodedMedia(Protocol):
    """One image or video, preprocessed (pixels still uint8), ready to join a batch."""

    kind: str  # "image" | "video"
    vision_tokens: int  # placeholder tokens in the prompt = encoder output tokens
    size: tuple[int, int]  # (width, height) in pixels the model sees (a video: each frame)


class CaptionInputs(Protocol):
    """Prompts and pixels for one family's checkpoints, built without torchvision."""

    # The instruction the caption command gives where the user names none; None: a caption's
    # (`--prompt`'s default). A document reader's is its model card's OCR instruction.
    default_prompt: str | None
    # Whether `encode_video` takes videos (False: the command refuses them before decoding).
    reads_videos: bool
    # The resolution arguments of `from_pretrained` this family reads (the others it ignores, and
    # the caption command refuses their flags for it).
    resolution_arguments: tuple[str, ...]

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        max_tiles: int | None = None,
        max_image_tokens: int | None = None,
        max_frame_tokens: int | None = None,
    ) -> "CaptionInputs":
        """The tokenizer and processor of a checkpoint directory, with a resolution policy: for
        families that tile images, `max_tiles` tiles per image; for families that size their grid
        to the image, `max_image_tokens` vision tokens per image and `max_frame_tokens` per pair of
        video frames (None: the checkpoint's own limits). A family ignores what does not apply to it."""
        ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def generation_overrides(self) -> dict[str, Any]:
        """`generate` settings the caption command passes whatever the checkpoint's generation
        config says, beside its own flags': the end and padding ids of these inputs, and any
        setting the family's checkpoints ship that the command does not mean to apply."""
        ...

    @property
    def min_side(self) -> int:
        """Smallest image side the processor takes (smaller ones are grown to it)."""
        ...

    @property
    def max_image_pixels(self) -> int:
        """The most pixels the processor keeps of an image (a JPEG decodes reduced to about this)."""
        ...

    @property
    def max_frame_pixels(self) -> int: ...

    @property
    def frame_size(self) -> "Callable[[int, int, int], tuple[int, int]] | tuple[int, int]":
        """The size each video frame is scaled to, once, as it is decoded (`encode_video` then
        takes it unresized): a fixed (width, height) (InternVL's tile), or a picklable, torch-free
        callable of the clip's (width, height, frames) (Qwen-VL's `video_size`): the video
        decoder calls it in its worker processes."""
        ...

    def check_model(self, config: Any) -> None:
        """Raise ValueError when these inputs' token ids or patch sizes do not fit the model."""
        ...

    def encode_image(self, image: Any) -> EncodedMedia: ...

    def encode_video(self, frames: Any, metadata: Any = None) -> EncodedMedia:
        """`frames`: images, or a uint8 array (frames, height, width, 3) at `frame_size`;
        `metadata`: their timing, with the keys of transformers' `VideoMetadata`."""
        ...

    def batch(
        self, items: Sequence[EncodedMedia], prompts: str | Sequence[str], device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, torch.Tensor]:
        """Left-padded inputs for `model.generate(**batch)`, equal to the official processor's on
        the CPU in float32 (the default); items keep their order. `prompts`: one for every item,
        or one per item. `to_model(collate(items, prompts), device, dtype)`."""
        ...

    def collate(self, items: Sequence[EncodedMedia], prompts: str | Sequence[str]) -> dict[str, torch.Tensor]:
        """The batch on the CPU, its pixels still uint8; touches no GPU (a worker thread may
        build the next batch while the model runs)."""
        ...

    def to_model(
        self, collated: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """`collate`'s batch on `device`, pixels normalised there as the processor does, in `dtype`."""
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        """Caption text of new token ids (special tokens dropped)."""
        ...

    def longest_prompt(self, prompt: str, max_frames: int) -> int:
        """The most tokens one prompt can reach: `prompt` around the largest image or video
        (of `max_frames` frames; 0: no video) the processor lets through."""
        ...
