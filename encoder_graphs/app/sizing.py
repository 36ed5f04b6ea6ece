"""`--batch-size auto`: the most sequences the GPU memory left after the weights holds, counted
from the language model's sizes and the resolution policy's longest sequence, not guessed.

A sequence holds, for the whole run, its rows of the decoder's static KV cache (`longest` slots;
a hybrid model's linear-attention layers hold fixed-size conv and recurrent states instead) and its
logits; while its batch is prefilled it also holds the prefill's own keys and values, the widest
layer's activations (the MLP: gate, up and their product) over its prompt, and its pixels (as
many a vision token as the model's family says), features and prompt embeddings. The encoder's
eager work is bounded by its largest budget (`EncoderCudaGraphManager` packs even eager
sub-batches into budgets), so it sits in the fixed reserve with the graph pools and library
workspaces.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from encoder_graphs.models.registry import family_for_config
from encoder_graphs.seam.text import linear_attention_layers, linear_state_shapes, mixer_width, text_head_dim

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

GIB = 2**30
# Graph pools, the encoder's largest eager sub-batch, cuBLAS / attention workspaces and the
# allocator's slack.
RESERVE_BYTES = 2 * GIB
AUTO_BATCH_MAX = 64
AUTO_BATCH_DEFAULT = 8  # without CUDA, where memory does not bound the batch


@dataclass(frozen=True)
class TextSizes:
    """The model's sizes that its memory per sequence depends on: its language model's, and the
    pixels one vision token of a prompt is encoded from (`model_sizes`; 0: prompts of text)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    mixer_width: int  # the widest token mixer's projection outputs a token (`seam.text.mixer_width`)
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int
    # Layers of linear attention (no keys and values; a fixed state per sequence), and that state.
    linear_layers: int = 0
    linear_state_bytes: int = 0
    pixel_bytes_per_vision_token: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            least = 0 if name.startswith(("linear", "pixel")) else 1
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if self.linear_layers >= self.num_layers:
            raise ValueError(f"linear_layers {self.linear_layers} leaves no attention layer of {self.num_layers}")

    @classmethod
    def of(cls, text_config: object, dtype_bytes: int, pixel_bytes_per_vision_token: int = 0) -> "TextSizes":
        """From a transformers text config (`config.get_text_config(decoder=True)`)."""
        linear = len(linear_attention_layers(text_config))
        state_bytes = 0
        if linear:
            (channels, taps), (value_heads, key_dim, value_dim) = linear_state_shapes(text_config)
            # The conv state in the model's dtype, the recurrent state in fp32 (as the static store).
            state_bytes = channels * taps * dtype_bytes + value_heads * key_dim * value_dim * 4
        return cls(
            num_layers=text_config.num_hidden_layers,
            hidden_size=text_config.hidden_size,
            intermediate_size=text_config.intermediate_size,
            mixer_width=mixer_width(text_config),
            num_kv_heads=text_config.num_key_value_heads,
            head_dim=text_head_dim(text_config),
            vocab_size=text_config.vocab_size,
            dtype_bytes=dtype_bytes,
            linear_layers=linear,
            linear_state_bytes=state_bytes,
            pixel_bytes_per_vision_token=pixel_bytes_per_vision_token,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * (self.num_layers - self.linear_layers) * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def state_bytes(self) -> int:
        """The linear-attention layers' states of one sequence (twice: the prefill's and the static store's)."""
        return 2 * self.linear_layers * self.linear_state_bytes


def model_sizes(config: "PretrainedConfig", dtype_bytes: int) -> TextSizes:
    """The sizes of a model of `config` whose weights are `dtype_bytes` wide: its language
    model's, and its family's pixels per vision token (`ModelFamily.pixel_values_per_vision_token`)
    in that dtype, which is the pixels' on the device."""
    pixels = family_for_config(config).adapter.pixel_values_per_vision_token(config)
    return TextSizes.of(config.get_text_config(decoder=True), dtype_bytes, pixels * dtype_bytes)


@dataclass(frozen=True)
class SequenceMemory:
    """Bytes one sequence needs: `resident` for the whole run, `prefill` more while its batch is
    prefilled."""

    resident: int
    prefill: int

    @property
    def peak(self) -> int:
        return self.resident + self.prefill


def sequence_memory(sizes: TextSizes, longest: int, longest_prompt: int) -> SequenceMemory:
    """A sequence of at most `longest` tokens, `longest_prompt` of them prompt (vision tokens
    counted as prompt tokens, the bound)."""
    if not 0 < longest_prompt <= longest:
        raise ValueError(f"longest_prompt {longest_prompt} must be in [1, longest {longest}]")
    item = sizes.dtype_bytes
    logits = sizes.vocab_size * (4 + 2 * item)  # fp32 and the model's dtype
    resident = sizes.kv_bytes_per_token * longest + sizes.state_bytes + logits
    widest = 2 * sizes.hidden_size + 3 * sizes.intermediate_size + sizes.mixer_width
    per_prompt_token = (
        sizes.kv_bytes_per_token  # the prefill's own cache, copied into the static one after
        + widest * item
        + 2 * sizes.hidden_size * item  # prompt embeddings and vision features
        + sizes.pixel_bytes_per_vision_token
    )
    return SequenceMemory(resident, per_prompt_token * longest_prompt)


def batch_size_for(
    free_bytes: int, per_sequence: SequenceMemory, most: int = AUTO_BATCH_MAX, multiple: int = 8
) -> int:
    """The most sequences (up to `most`; a multiple of `multiple` from `multiple` on: 8 for the
    decoder's buckets) whose peak fits `free_bytes` less the reserve; at least 1. `--batch-size N`
    is capped so (multiple 1): a batch whose cache cannot be allocated fails every file."""
    fits = max(0, free_bytes - RESERVE_BYTES) // per_sequence.peak
    return max(1, min(most, fits if fits < multiple else fits - fits % multiple))


def batch_sizes_for(
    free_bytes: int, sizes: TextSizes, longest: int, prompts: dict[str, int], most: dict[str, int],
    multiple: int = 8,
) -> dict[str, int]:
    """`batch_size_for` for each kind of file (its longest prompt in `prompts`, at most `most` of
    it) where one static cache of `longest` slots serves them all: its rows are the largest
    kind's batch, so a kind of longer prompts gets what the prefill can take beside that cache.
    Photos are not batched by a video's prompt; both are bounded by the cache the longest
    sequence sizes."""
    first = {kind: batch_size_for(free_bytes, sequence_memory(sizes, longest, prompt), most[kind], multiple)
             for kind, prompt in prompts.items()}
    rows = max(first.values())
    resident = sequence_memory(sizes, longest, 1).resident
    result = {}
    for kind, prompt in prompts.items():
        fits = max(0, free_bytes - RESERVE_BYTES - rows * resident) // sequence_memory(sizes, longest, prompt).prefill
        result[kind] = max(1, min(first[kind], fits if fits < multiple else fits - fits % multiple))
    return result


def fitting_batch_sizes(
    requested: int | None, model: "PreTrainedModel", longest: int, prompts: dict[str, int], files: dict[str, int],
    device: "torch.device", held_later: int = 0,
) -> dict[str, int]:
    """Per kind of file (its longest prompt in `prompts`, its count in `files`, which no batch
    exceeds): `--batch-size N`, capped on a GPU at the most sequences its free memory holds beside
    the cache of `longest` slots (a batch whose cache cannot be allocated would fail every file);
    `auto` (`requested` None): that most, up to 64 (`batch_sizes_for`), as throughput grows with the
    batch (RESULTS.md). Without CUDA, N or 8. `held_later`: bytes of the GPU that other processes
    take after this measurement (NVDEC's decoder workers), left out of the free memory."""
    if device.type != "cuda":
        return {kind: min(requested or AUTO_BATCH_DEFAULT, files[kind]) for kind in prompts}
    import torch

    sizes = model_sizes(model.config, model.dtype.itemsize)
    free, _ = torch.cuda.mem_get_info(device)
    free = max(0, free - held_later)
    most = {kind: min(requested or AUTO_BATCH_MAX, files[kind]) for kind in prompts}
    return batch_sizes_for(free, sizes, longest, prompts, most, multiple=1 if requested else 8)
