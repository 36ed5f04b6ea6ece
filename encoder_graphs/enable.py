"""Plugin entry: route a stock transformers VLM's image and video encoding through encoder graphs,
and its `generate` through decoder graphs.

The model instance's own `get_image_features` / `get_video_features` are replaced by versions that
call `EncoderCudaGraphManager.execute` and rebuild exactly the output transformers returns, so its
`forward` and `generate` use the graphs unchanged. The instance's `generate` is replaced by one that
hands the calls the decoder runner supports to `DecoderGraphRunner.generate` and every other call to
the original. Weights are padded, permuted or stacked where a faster kernel takes them so, on
the same parameter objects. Every change is recorded on one undo stack (`encoder_graphs/rewrites/`):
`disable()`, or a failed enable, unwinds it, and meanwhile `state_dict()` (so `save_pretrained`)
gives the stock weights.

Left registered, by design: the attention functions registered with transformers under our own
names (`encoder_graphs_*`) and the torch custom ops `encoder_graphs::*`. Both tables are
process-wide (another model enabled in the process may be using them; a custom op cannot be
unregistered), and nothing runs them unless a config names them or our code calls them: no
config does after `disable()`, as none did before enable.
"""

import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from encoder_graphs.decoder.generation import StockOnly, runner_arguments, runner_settings
from encoder_graphs.decoder.layers.stack import pointwise_parts, warm_up_parts
from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.engine.compile import CompiledBlocks, compile_blocks
from encoder_graphs.engine.manager import EncoderCudaGraphManager
from encoder_graphs.engine.statistics import GraphStats
from encoder_graphs.models.registry import adapter_for
from encoder_graphs.options import GraphOptions
from encoder_graphs.protocols import ModelFamily
from encoder_graphs.report import format_graph_stats
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam import check_version


class EncoderGraphsHandle:
    """What `enable_cuda_graphs` returns: the encoder manager, the adapter, the decoder runner
    (None with `decoder=False` or a language model it cannot graph: `decoder_off` says which),
    statistics and `disable()`."""

    def __init__(
        self,
        model: nn.Module,
        adapter: ModelFamily,
        manager: EncoderCudaGraphManager,
        decoder: DecoderGraphRunner | None,
        compiled: CompiledBlocks | None,
        rewrites: Rewrites,
        decoder_off: str | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.manager = manager
        self.decoder = decoder
        self.decoder_off = decoder_off  # why `decoder` is None: `generate` stays stock
        self.options = GraphOptions()  # what `enable_cuda_graphs` was given
        self.compiled = compiled
        self.generate_fallbacks: Counter = Counter()  # reason -> generate calls sent to the original
        self._rewrites = rewrites

    def stats(self) -> GraphStats:
        """Typed and frozen; it reads like the dict it was (`stats()["encoder"]["items"]`), and
        `to_json()` is that dict (`engine/statistics.py`)."""
        compiled = self.compiled.typed_stats() if self.compiled else None
        return GraphStats(
            encoder=replace(self.manager.typed_stats(), compile=compiled),
            decoder=self.decoder.typed_stats() if self.decoder is not None else None,
            decoder_off=self.decoder_off,
            generate_fallbacks=dict(self.generate_fallbacks),
        )

    def format_stats(self) -> str:
        return format_graph_stats(self.stats())

    def decode_route(self, settings: dict[str, Any]) -> tuple[DecoderGraphRunner, dict[str, Any]] | None:
        """The decoder runner and the settings of its calls for generate calls made with
        `settings` (a caller's that gives every call the same, as the caption command does, and
        calls the runner itself), or None where such calls go to the stock `generate`."""
        if self.decoder is None:
            return None
        try:
            return self.decoder, runner_settings(self.model, settings)
        except StockOnly:
            return None

    def disable(self) -> None:
        """Undo every change to the model, last first, and free the graphs: each parameter is
        the object it was, with its values, `requires_grad` and kind (`encoder_graphs/rewrites/`)."""
        self._rewrites.undo()


def enable_cuda_graphs(model: nn.Module, options: GraphOptions | None = None, **settings: Any) -> EncoderGraphsHandle:
    """Capture `model`'s vision encoder at token budgets and route its image/video features
    through the graphs; unless `options.decoder` is False, capture its decode step per batch-size
    bucket and length tier over a static cache and route `model.generate` through them.
    `options`: every setting (`GraphOptions`, defaults where None); keyword `settings` of the same
    names change some of them (`enable_cuda_graphs(model, lazy=True)`). Raises ValueError for an
    unsupported architecture, TypeError for a setting `GraphOptions` does not have.

    `model.generate` reads its settings as transformers does (arguments > a `generation_config`
    argument > `model.generation_config` > transformers' defaults). Calls with greedy or
    temperature / top-p sampling, `max_new_tokens`, EOS / pad ids, an attention mask and the
    model's image / video inputs go to the decoder graphs. Any setting, argument or model input
    not known to be handled (an allow-list, `decoder/generation.py`: a setting a later
    transformers adds goes to stock too) sends the call to the original `generate`, counted by
    reason in `stats()["generate_fallbacks"]`: beams, streamers, logits processors or
    stopping criteria, scores or dicts in the output, no `max_new_tokens`, and (when sampling)
    top-k, which transformers sets to 50 by default, so pass `top_k=0` to sample through the
    graphs. Real Qwen-VL checkpoints ship `repetition_penalty=1.05` in their generation config:
    their calls reach the graphs only with `repetition_penalty=1.0` given explicitly. Sampling
    takes `generator=`, a `torch.Generator` or one per row (a row's tokens then depend on its own
    generator only); such a call must reach the graphs, else ValueError.
    """
    if getattr(model, "_encoder_graphs", None) is not None:
        raise RuntimeError("encoder graphs are already enabled on this model; disable() them first")
    check_version()
    if options is not None and not isinstance(options, GraphOptions):
        raise TypeError(f"options must be a GraphOptions, got {type(options).__name__}")
    options = replace(GraphOptions() if options is None else options, **settings)
    adapter = adapter_for(model, attn_backend=options.attn_backend)
    # Every change to the model and every resource holding graphs, undone last first by
    # disable(), or here if anything raises before the handle is returned.
    rewrites = Rewrites()
    with rewrites.undone_on_error():
        manager = EncoderCudaGraphManager(adapter, options.encoder_options)
        rewrites.push(manager.close)
        runner = None
        decoder_off = "decoder=False" if not options.decoder else DecoderGraphRunner.unsupported(model.config)
        if decoder_off is None:
            runner = DecoderGraphRunner(model, options.decoder_options, family=adapter)
            rewrites.push(runner.close)  # gives the stacked projections back
        adapter.align_weights(rewrites)  # exact
        compiled = _compile(model, adapter, manager, runner, rewrites) if options.compile else None
        manager.capture()
        if runner is not None:
            runner.capture()
        handle = EncoderGraphsHandle(model, adapter, manager, runner, compiled, rewrites, decoder_off)
        handle.options = options
        for owner in (model, getattr(model, "model", None)):
            if owner is None:
                continue
            for name in adapter.feature_methods:
                original = getattr(owner, name, None)
                if callable(original):
                    rewrites.patch(owner, name, _graphed_features(handle, name, original))
        if runner is not None:
            rewrites.patch(model, "generate", _graphed_generate(handle, runner, model.generate))
        rewrites.patch(model, "_encoder_graphs", handle)
    return handle


def graphs_of(model: nn.Module) -> EncoderGraphsHandle | None:
    """The handle `enable_cuda_graphs` attached to `model`, or None (not enabled, or disabled)."""
    return getattr(model, "_encoder_graphs", None)


def _compile(
    model: nn.Module,
    adapter: ModelFamily,
    manager: EncoderCudaGraphManager,
    runner: DecoderGraphRunner | None,
    rewrites: Rewrites,
) -> CompiledBlocks:
    """The encoder's repeated blocks and, with the decoder runner, the language model's MLPs and
    norms (its prefill) and the decode step's layers, compiled by warm-ups of each before any capture."""
    if runner is None:
        return compile_blocks(adapter.repeated_blocks(), manager.warm_up, rewrites)
    decode_layers = runner.stack.layers if runner.stack is not None else []

    def warm_up() -> None:
        manager.warm_up()
        warm_up_parts(model)
        if decode_layers:
            runner.warm_up()

    return compile_blocks([*adapter.repeated_blocks(), *pointwise_parts(model), *decode_layers], warm_up, rewrites)


def _graphed_generate(handle: EncoderGraphsHandle, runner: DecoderGraphRunner, original: Callable) -> Callable:
    model = handle.model

    def generate(
        inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *args, **kwargs
    ):
        generator = kwargs.pop("generator", None)  # ours: the stock generate has none
        try:
            if args:
                raise StockOnly("positional arguments after generation_config")
            arguments = runner_arguments(model, inputs, generation_config, kwargs)
            if unfit := runner.call_unfit(*arguments["input_ids"].shape, arguments["max_new_tokens"]):
                raise StockOnly(unfit)
        except StockOnly as why:
            if generator is not None:
                raise ValueError(f"generator= needs the decoder graphs; this call goes to stock: {why}") from why
            handle.generate_fallbacks[str(why)] += 1
            return original(inputs, generation_config, *args, **kwargs)
        return runner.generate(**arguments, generator=generator)

    generate.__doc__ = "generate through decoder CUDA graphs where supported (encoder_graphs.enable_cuda_graphs)."
    return generate


def _graphed_features(handle: EncoderGraphsHandle, name: str, original: Callable) -> Callable:
    adapter = handle.adapter
    # The replacement keeps the original's signature: generate (transformers >= 5.18) passes the
    # inputs whose names that signature lists, by keyword.
    signature = inspect.signature(original)

    def features(*args, **kwargs):
        arguments = _named_arguments(signature, args, kwargs)  # a wrong call raises TypeError here
        # A tuple asked for leads with the tower's last hidden state, which the graphs do not keep.
        inputs = None if arguments.get("return_dict") is False else adapter.feature_inputs(name, arguments)
        if inputs is None:
            return original(*args, **kwargs)
        return adapter.feature_output(name, handle.manager.execute(inputs), arguments)

    features.__name__ = name
    features.__signature__ = signature
    features.__doc__ = f"{name} through encoder CUDA graphs (encoder_graphs.enable_cuda_graphs)."
    return features


def _named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every argument of a call by its parameter name, `**kwargs` spread out."""
    named: dict[str, Any] = {}
    for key, value in signature.bind(*args, **kwargs).arguments.items():
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[key] = value
    return named
