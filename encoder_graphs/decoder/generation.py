"""Which `generate` calls the decoder graphs can answer, with the settings read as transformers
reads them: arguments > a `generation_config` argument > `model.generation_config` > defaults.

The runner implements greedy and temperature / top-p sampling with EOS and pad ids. Any other
setting that would change the tokens (a repetition penalty, top-k, beams, logits processors,
streamers, scores in the output ...) sends the call to the stock `generate`, with the reason.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from encoder_graphs.models.transformers_seam import GenerationMode, prepare_generation_config

# generate() arguments that only the stock loop implements.
_STOCK_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "tokenizer",
    "assistant_tokenizer",
)
# Model inputs the runner builds itself (positions, cache) or cannot take.
_STOCK_INPUTS = ("past_key_values", "inputs_embeds", "position_ids", "cache_position", "logits_to_keep")


def _unset_or(value: Any, inactive: tuple) -> bool:
    return value is None or value in inactive


# Settings that change the tokens, and when each is active (the conditions transformers uses to add
# its logits processor or stopping criterion). `renormalize_logits` is absent: a log-softmax keeps
# both the argmax and the sampling distribution.
_SETTINGS: dict[str, Callable[[GenerationConfig], bool]] = {
    "num_return_sequences": lambda c: not _unset_or(c.num_return_sequences, (1,)),
    "repetition_penalty": lambda c: not _unset_or(c.repetition_penalty, (1.0,)),
    "encoder_repetition_penalty": lambda c: not _unset_or(c.encoder_repetition_penalty, (1.0,)),
    "no_repeat_ngram_size": lambda c: (c.no_repeat_ngram_size or 0) > 0,
    "encoder_no_repeat_ngram_size": lambda c: (c.encoder_no_repeat_ngram_size or 0) > 0,
    "bad_words_ids": lambda c: c.bad_words_ids is not None,
    "sequence_bias": lambda c: c.sequence_bias is not None,
    "guidance_scale": lambda c: not _unset_or(c.guidance_scale, (1.0,)),
    "min_length": lambda c: (c.min_length or 0) > 0,
    "min_new_tokens": lambda c: (c.min_new_tokens or 0) > 0,
    "forced_bos_token_id": lambda c: c.forced_bos_token_id is not None,
    "forced_eos_token_id": lambda c: c.forced_eos_token_id is not None,
    "remove_invalid_values": lambda c: bool(c.remove_invalid_values),
    "exponential_decay_length_penalty": lambda c: c.exponential_decay_length_penalty is not None,
    "suppress_tokens": lambda c: c.suppress_tokens is not None,
    "begin_suppress_tokens": lambda c: c.begin_suppress_tokens is not None,
    "watermarking_config": lambda c: c.watermarking_config is not None,
    "max_time": lambda c: c.max_time is not None,
    "stop_strings": lambda c: c.stop_strings is not None,
    "output_scores": lambda c: bool(c.output_scores),
    "output_logits": lambda c: bool(c.output_logits),
    "output_attentions": lambda c: bool(c.output_attentions),
    "output_hidden_states": lambda c: bool(c.output_hidden_states),
    "return_dict_in_generate": lambda c: bool(c.return_dict_in_generate),
    "use_cache": lambda c: c.use_cache is False,
    "cache_implementation": lambda c: c.cache_implementation is not None,
    "prefill_chunk_size": lambda c: c.prefill_chunk_size is not None,
}
# Warpers transformers applies only when sampling. Its default top_k is 50: sampling reaches the
# graphs only with top_k=0 (or None) given explicitly.
_SAMPLING_SETTINGS: dict[str, Callable[[GenerationConfig], bool]] = {
    "top_k": lambda c: not _unset_or(c.top_k, (0,)),
    "top_h": lambda c: c.top_h is not None,
    "min_p": lambda c: c.min_p is not None,
    "typical_p": lambda c: not _unset_or(c.typical_p, (1.0,)),
    "epsilon_cutoff": lambda c: 0.0 < (c.epsilon_cutoff or 0.0) < 1.0,
    "eta_cutoff": lambda c: 0.0 < (c.eta_cutoff or 0.0) < 1.0,
}


class StockOnly(Exception):
    """A `generate` call the decoder graphs cannot answer; the message is the reason."""


def runner_arguments(
    model: torch.nn.Module,
    inputs: torch.Tensor | None,
    generation_config: GenerationConfig | None,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Keyword arguments of `DecoderGraphRunner.generate` for `model.generate(inputs,
    generation_config, **kwargs)`. Raises StockOnly when only the stock `generate` can answer."""
    for name in _STOCK_ARGUMENTS:
        if _is_set(kwargs.get(name)):
            raise StockOnly(f"argument {name}")
    kwargs = {name: value for name, value in kwargs.items() if name not in _STOCK_ARGUMENTS}
    config, model_inputs = prepare_generation_config(model, generation_config, kwargs)

    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise StockOnly(f"generation mode {mode.value}")
    settings = {**_SETTINGS, **(_SAMPLING_SETTINGS if config.do_sample else {})}
    for name, active in settings.items():
        if active(config):
            raise StockOnly(f"{name}={getattr(config, name)!r}")
    if config.max_new_tokens is None:
        raise StockOnly("max_new_tokens not set")

    model_inputs = {name: value for name, value in model_inputs.items() if value is not None}
    for name in _STOCK_INPUTS:
        if name in model_inputs:
            raise StockOnly(f"input {name}")
    if inputs is not None and "input_ids" in model_inputs:
        raise StockOnly("both inputs and input_ids")
    input_ids = inputs if inputs is not None else model_inputs.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise StockOnly("input_ids missing or not [batch, length]")
    attention_mask = model_inputs.pop("attention_mask", None)
    if attention_mask is None:
        attention_mask = _inferred_attention_mask(input_ids, config)

    sampling = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p}
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "max_new_tokens": config.max_new_tokens,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        **(sampling if config.do_sample else {}),
        **model_inputs,
    }


def _is_set(value: Any) -> bool:
    """An argument that asks for something: not None / False / an empty processor list."""
    if value is None or value is False:
        return False
    return not (isinstance(value, list) and not value)


def token_id_list(ids: int | Sequence[int] | None) -> list[int]:
    """Token ids as generation configs give them (one id, several, or None), as a list."""
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def _inferred_attention_mask(input_ids: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """What generate infers without a mask: pad positions masked, unless the pad id is also an EOS id."""
    pad = config.pad_token_id
    if pad is None or pad in token_id_list(config.eos_token_id) or not bool((input_ids == pad).any()):
        return torch.ones_like(input_ids)
    return (input_ids != pad).long()
