"""Which `generate` calls the decoder graphs can answer, with the settings read as transformers
reads them: arguments > a `generation_config` argument > `model.generation_config` > defaults.

The runner implements greedy and temperature / top-p sampling with EOS and pad ids. The settings,
arguments and model inputs it handles are listed here (an allow-list): anything else set, a
setting that a later transformers adds included, sends the call to the stock `generate`, with
the reason.
"""

from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from encoder_graphs.models.registry import family_class
from encoder_graphs.seam.generation import (
    GenerationMode,
    generate_arguments,
    generation_settings,
    prepare_generation_config,
)

ANY = None  # any value: the runner implements the setting, or it cannot change the runner's tokens
# Each setting the runner handles: ANY, or the values at which transformers adds nothing for it
# (no logits processor, no stopping criterion). A setting of the running transformers that is
# not listed here sends a call to the stock generate whenever it is set (not None).
_HANDLED: dict[str, tuple | None] = {
    # Implemented by the runner.
    "max_new_tokens": ANY,
    "do_sample": ANY,
    "eos_token_id": ANY,
    "pad_token_id": ANY,
    # No effect on the runner's tokens: max_new_tokens (required) wins over max_length; a BOS id
    # only starts an empty prompt and a decoder start id an encoder-decoder; compile settings
    # apply to a static cache's forward (a cache_implementation, which goes to stock); a
    # log-softmax keeps the argmax and the sampling distribution.
    "max_length": ANY,
    "bos_token_id": ANY,
    "decoder_start_token_id": ANY,
    "compile_config": ANY,
    "disable_compile": ANY,
    "renormalize_logits": ANY,
    # Read only by generation modes other than greedy and sampling, which go to stock by mode.
    "num_beams": ANY,
    "num_beam_groups": ANY,
    "early_stopping": ANY,
    "length_penalty": ANY,
    "diversity_penalty": ANY,
    "penalty_alpha": ANY,
    "low_memory": ANY,
    "num_assistant_tokens": ANY,
    "num_assistant_tokens_schedule": ANY,
    "assistant_confidence_threshold": ANY,
    "assistant_lookbehind": ANY,
    "target_lookbehind": ANY,
    "max_matching_ngram_size": ANY,
    "is_assistant": ANY,
    # Inactive at these values.
    "use_cache": (True,),
    "num_return_sequences": (1,),
    "min_length": (0,),
    "min_new_tokens": (0,),
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "guidance_scale": (1.0,),
    "remove_invalid_values": (False,),
    "token_healing": (False,),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "output_scores": (False,),
    "output_logits": (False,),
    "return_dict_in_generate": (False,),
}
# Warpers transformers applies only when sampling (greedy ignores them), and what the runner
# handles of them then. Its default top_k is 50: sampling reaches the graphs only with top_k=0
# (or None) given explicitly.
_SAMPLING: dict[str, tuple | None] = {
    "temperature": ANY,
    "top_p": ANY,
    "top_k": (0,),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "min_p": (),
    "top_h": (),
}
# Model inputs the runner builds or takes itself (the prompts' position ids as generate would
# compute them, or computed ahead, e.g. on a worker thread); a family adds those its prefill consumes.
_RUNNER_INPUTS = ("input_ids", "attention_mask", "position_ids")


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
    for name in generate_arguments():
        if _is_set(kwargs.get(name)):
            raise StockOnly(f"argument {name}")
    kwargs = {name: value for name, value in kwargs.items() if name not in generate_arguments()}
    config, model_inputs = prepare_generation_config(model, generation_config, kwargs)
    settings = _runner_settings(config)
    model_inputs = {name: value for name, value in model_inputs.items() if value is not None}
    family = family_class(model)
    known = (*_RUNNER_INPUTS, *(family.generate_inputs if family is not None else ()))
    for name in model_inputs:
        if name not in known:
            raise StockOnly(f"input {name}")
    if inputs is not None and "input_ids" in model_inputs:
        raise StockOnly("both inputs and input_ids")
    input_ids = inputs if inputs is not None else model_inputs.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise StockOnly("input_ids missing or not [batch, length]")
    attention_mask = model_inputs.pop("attention_mask", None)
    if attention_mask is None:
        attention_mask = _inferred_attention_mask(input_ids, config)

    return {"input_ids": input_ids, "attention_mask": attention_mask, **settings, **model_inputs}


def runner_settings(model: torch.nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of the runner's own calls (`generate`, `generate_shared`) that decode as
    `model.generate(**settings, ...)` would: the checkpoint's generation config merged with
    `settings` as transformers merges them. For callers that give every call the same settings
    (the caption command), resolved once. Raises StockOnly when only the stock `generate` can."""
    config, _ = prepare_generation_config(model, None, dict(settings))
    return _runner_settings(config)


def _runner_settings(config: GenerationConfig) -> dict[str, Any]:
    """`max_new_tokens`, EOS and pad ids and the sampling of a merged `config`; StockOnly where
    the runner cannot decode by it."""
    if (refusal := config_refusal(config)) is not None:
        raise StockOnly(refusal)
    if config.max_new_tokens is None:
        raise StockOnly("max_new_tokens not set")
    sampling = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p}
    return {
        "max_new_tokens": config.max_new_tokens,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        **(sampling if config.do_sample else {}),
    }


def config_refusal(config: GenerationConfig) -> str | None:
    """Why the runner cannot decode by `config` (a mode or a setting it lacks), or None."""
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value}"
    return unhandled_setting(config)


def unhandled_setting(config: GenerationConfig) -> str | None:
    """`name=value` of the first setting of `config` the runner does not handle, or None.
    Settings the running transformers does not define (a checkpoint's own extra keys) are
    ignored, as transformers ignores them."""
    for name in generation_settings():
        value = getattr(config, name, None)
        if value is None:
            continue
        if name in _SAMPLING:
            if not config.do_sample:
                continue
            allowed = _SAMPLING[name]
        else:
            allowed = _HANDLED.get(name, ())
        if allowed is not ANY and value not in allowed:
            return f"{name}={value!r}"
    return None


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
