"""A named model config: the config class, the model and vision-tower classes, and the text and
vision settings; plus the tiny text stack the CPU presets share."""

from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class Preset:
    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]
    vision_class: type[PreTrainedModel]
    text: dict[str, Any]
    vision: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    # Parameters (name fragments) that stock init zeroes and a checkpoint holds trained: drawn at
    # random by `build_model` as the other weights are, so that a random model exercises them.
    drawn: tuple[str, ...] = ()

    def config(self) -> PretrainedConfig:
        return self.config_class(
            text_config=dict(self.text), vision_config=dict(self.vision), **self.extra
        )


TINY_TEXT = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=1,
)
