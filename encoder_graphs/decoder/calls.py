"""The generate calls of `DecoderGraphRunner`: the prefill (whole prompts, or prompts that share
their prefix: `decoder/shared.py`) into its static cache, then the decode steps over its routes
and length tiers (`decoder/runner.py`)."""

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from encoder_graphs.decoder.generation import token_id_list
from encoder_graphs.decoder.routes import Route
from encoder_graphs.decoder.sampling import Sampling, select_next_tokens
from encoder_graphs.decoder.shared import SharedPrompts, shared_prefill
from encoder_graphs.decoder.static_cache import StaticKVStore
from encoder_graphs.decoder.step import packed_prefill, prefill
from encoder_graphs.decoder.tokens import NewTokens

# What a call's prefill gives the decode: the first logits, the mask over the prompt's slots and
# the next position ids; it fills the static store it is handed (None: no step follows).
PrefillInto = Callable[[StaticKVStore | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class GenerateCalls:
    """`generate` and `generate_shared` of `DecoderGraphRunner`, which supplies the model, the
    routes, tiers and steps, and the counters."""

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        stop_check_interval: int = 8,
        **settings: Any,
    ) -> torch.Tensor:
        """Prompt ids followed by new ids, [batch, prompt_len + new], as `generate` returns them:
        left-padded prompts in, finished sequences padded with `pad_token_id` after their EOS.
        `settings`: the sampling's (`Sampling`) and the model inputs of the prefill."""
        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        sampling, model_inputs = Sampling.split(settings)

        def prefill_into(store: StaticKVStore | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            inputs = self._model_inputs(model_inputs)
            # Packed only when left-padded: generate reads the last column's logits, a pad's elsewhere.
            packed = self.packed_prefill and bool(mask[:, -1].all())
            prefilled = packed_prefill(self.model, input_ids, mask, inputs, self._text_position_row) if packed else prefill(
                self.model, input_ids, mask, inputs)
            if store is not None:
                store.load_prefill(prefilled.key_values, prefilled.slots)
            return prefilled.logits, mask, prefilled.next_positions

        new_ids = self._generate(len(input_ids), input_ids.shape[1], max_new_tokens, stop_check_interval, sampling,
                                 prefill_into)
        return torch.cat([input_ids, new_ids], dim=1)

    def generate_shared(
        self,
        prefix_ids: torch.Tensor,
        prefix_mask: torch.Tensor,
        shared: SharedPrompts,
        *,
        max_new_tokens: int,
        stop_check_interval: int = 8,
        **settings: Any,
    ) -> torch.Tensor:
        """New ids [rows, new] of `shared`'s rows, in its order: each row an item's prompt, the
        items' left-padded shared prefixes prefilled once (`decoder/shared.py`). `settings` as
        `generate`'s (a `generator` list: one a row)."""
        prefix_ids, prefix_mask = prefix_ids.to(self.device), prefix_mask.to(self.device)
        sampling, model_inputs = Sampling.split(settings)

        def prefill_into(store: StaticKVStore | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            done = shared_prefill(self.model, prefix_ids, prefix_mask, self._model_inputs(model_inputs), shared,
                                  packed=self.packed_prefill, load=store.load_rows if store is not None else None,
                                  text_position_row=self._text_position_row)
            return done.logits, done.mask, done.next_positions

        # The rows run in suffix-length groups (`SharedPrompts.order`): the generators there and back.
        order = shared.order()
        if not (sampling.generator is None or isinstance(sampling.generator, torch.Generator)):
            sampling.generator = [sampling.generator[row] for row in order]
        new_ids = self._generate(shared.rows, shared.length(prefix_ids.shape[1]), max_new_tokens, stop_check_interval,
                                 sampling, prefill_into)
        return new_ids[torch.tensor(order).argsort().to(new_ids.device)]

    def _generate(
        self,
        batch: int,
        prompt_len: int,
        max_new_tokens: int,
        stop_check_interval: int,
        sampling: Sampling,
        prefill_into: PrefillInto,
    ) -> torch.Tensor:
        """The new ids [batch, new] of sequences `prefill_into` prefills to `prompt_len` slots (into
        the static store it is given, none when no step follows), returning their first logits,
        their mask over the slots and their next positions."""
        if max_new_tokens < 1 or stop_check_interval < 1:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) and stop_check_interval must be >= 1")
        generator = sampling.generator
        if not (generator is None or isinstance(generator, torch.Generator) or len(generator) == batch):
            raise ValueError(f"{len(generator)} generators for {batch} rows")
        eos_ids = token_id_list(self.model.generation_config.eos_token_id if sampling.eos_token_id is None
                                else sampling.eos_token_id)
        if unfit := self.call_unfit(batch, prompt_len, max_new_tokens):
            raise ValueError(f"the decoder's static cache cannot hold this call: {unfit}")
        tokens = NewTokens(batch, max_new_tokens, eos_ids, self._pad_id(sampling.pad_token_id, eos_ids), self.device)
        sample = partial(select_next_tokens, params=sampling.params, generator=generator)
        with torch.inference_mode():
            route = self._route(batch, prompt_len + max_new_tokens - 1) if max_new_tokens > 1 else None
            if route is not None:  # before the prefill fills the static cache (a capture runs steps over it)
                self._capture_first_use(route, prompt_len + 1, prompt_len + max_new_tokens - 1)
            logits, mask, positions = prefill_into(route.buffers.store if route is not None else None)
            chosen = tokens.emit(0, sample(logits))
            if route is not None:
                route.buffers.start(batch=batch, rows=route.rows, prompt_mask=mask, next_positions=positions)
                del logits, positions
                self._decode(route, tokens, chosen, prompt_len, sample, stop_check_interval if eos_ids else 0)
            new_ids = tokens.generated()
        self.counters.sequences += batch
        self.counters.calls += 1
        return new_ids

    def _decode(
        self,
        route: Route,
        tokens: NewTokens,
        chosen: torch.Tensor,
        prompt_len: int,
        sample: Callable[[torch.Tensor], torch.Tensor],
        stop_check_interval: int,
    ) -> None:
        """Decode steps 1 .. max_new_tokens - 1, stopping early once every sequence has ended
        (checked every `stop_check_interval` steps; 0: never, when there is no EOS)."""
        batch, max_new_tokens = tokens.ids.shape
        tier = None
        started = self.counters.timer.start(self.device.type == "cuda")
        steps = 0
        for step in range(1, max_new_tokens):
            if stop_check_interval and step % stop_check_interval == 0 and tokens.finished():
                break
            # This step writes slot prompt_len + step - 1 and attends over every slot up to it.
            if tier is None or prompt_len + step > tier.tier:
                tier = self._tier(route, prompt_len + step)
            route.buffers.input_ids[:batch, 0].copy_(chosen)
            if tier.graph is not None:
                tier.graph.replay()
            else:
                self._step(route.buffers, route.rows, tier.tier, tier.cache)
            chosen = tokens.emit(step, sample(route.buffers.logits[:batch]))
            self.counters.count_step(route.rows, batch, tier.tier, tier.eager_reason)
            steps += 1
        self.counters.timer.stop(started, steps)

    def _model_inputs(self, model_inputs: dict) -> dict:
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in model_inputs.items()}
        if self.family is not None:
            self.family.check_decoder_inputs(inputs)
        return inputs

    def _pad_id(self, pad_token_id: int | None, eos_ids: list[int]) -> int:
        if pad_token_id is None:
            pad_token_id = self.model.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0  # what generate falls back to
        return int(pad_token_id)

