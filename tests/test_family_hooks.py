"""What the app and the decoder ask a model family through its hooks, not by its name: the
position row the packed prefill restarts, the `generate` settings the caption command overrides,
the help text of the options (the pixels per vision token: test_sizing.py). Tiny models, CPU."""

import os

import pytest
import torch
from PIL import Image

from encoder_graphs.app.cli import build_parser
from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.decoder.step import packed_prefill, prompt_positions
from encoder_graphs.models.registry import FAMILY_FOLDERS, families, family_for_config, option_help
from encoder_graphs.presets import PRESETS, build_model, get_config
from encoder_graphs.presets.files import preset_files_dir
from encoder_graphs.protocols import FamilyDefaults


@pytest.fixture(autouse=True)
def preset_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path_factory.getbasetemp() / "preset-cache"))


def test_every_family_has_the_hooks_and_says_its_text_position_row():
    """Qwen-VL's `generate` positions lead with a text row beside M-RoPE's three; the others'
    are one row (the neutral default)."""
    for family in families():
        assert issubclass(family.adapter, FamilyDefaults) and isinstance(family.adapter, type)
        assert all(hasattr(family.adapter, name) for name in ("text_position_row", "pixel_values_per_vision_token"))
        qwen = family.adapter.__module__.startswith("encoder_graphs.models.qwen")
        assert family.adapter.text_position_row == (0 if qwen else None), family.architecture
    assert FamilyDefaults.text_position_row is None


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl"])
def test_the_packed_prefill_restarts_the_row_the_family_names(name, tmp_path):
    """Position ids whose text row runs over the padding (as a caller may give them): the packed
    prefill hands the model that row restarted at each prompt, the family's row and no other;
    without a row named, the positions as given."""
    from test_decoder import make_batch

    build_model(name).save_pretrained(tmp_path)
    model = PRESETS[name].model_class.from_pretrained(tmp_path).eval()
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96)
    inputs = make_batch(model.config, [(1, 4, 4), (1, 8, 6)], text_only_lengths=(5,))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    others = runner._model_inputs(inputs)
    given = prompt_positions(model, ids, mask, dict(others)).clone()
    given[0] = torch.arange(ids.shape[1]).expand_as(ids)  # counted over the left padding too
    seen = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            for row in (runner.family.text_position_row, None):
                packed_prefill(model, ids, mask, dict(others, position_ids=given), row)
    finally:
        hook.remove()
    real = mask.bool()
    restarted, kept = seen
    within = torch.cat([torch.arange(int(n)) for n in real.sum(1)])
    assert torch.equal(restarted[0, 0], within) and not torch.equal(kept[0, 0], within)
    assert torch.equal(restarted[1:], kept[1:]) and torch.equal(kept[:, 0], given[:, real])


def test_the_caption_command_passes_the_familys_generation_overrides(tmp_path, monkeypatch):
    """A Qwen-VL checkpoint's repetition penalty (1.05) would send every caption call to stock
    `generate`: the family's inputs override it, beside the tokenizer's end and pad ids, and the
    pipeline passes what they say. A family whose checkpoints need nothing more says only the ids."""
    from encoder_graphs import enable_cuda_graphs
    from encoder_graphs.app.config import CaptionConfig
    from encoder_graphs.app.media import LoadLimits
    from encoder_graphs.app.outputs import Outputs, SidecarPolicy
    from encoder_graphs.app.pipeline import Captioner
    from encoder_graphs.app.results import ResultsFile, read_records
    from encoder_graphs.app.walk import discover

    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path / "cache"))
    internvl = family_for_config(get_config("tiny-internvl")).inputs.from_pretrained(preset_files_dir("tiny-internvl"))
    assert internvl.generation_overrides == {"eos_token_id": internvl.eos_token_id,
                                             "pad_token_id": internvl.pad_token_id}
    name = "tiny-qwen2-vl"
    build_model(name).save_pretrained(tmp_path / "model")
    model = PRESETS[name].model_class.from_pretrained(tmp_path / "model").eval()
    model.generation_config.repetition_penalty = 1.05
    inputs = family_for_config(model.config).inputs.from_pretrained(preset_files_dir(name))
    assert inputs.generation_overrides == {"eos_token_id": inputs.eos_token_id, "pad_token_id": inputs.pad_token_id,
                                           "repetition_penalty": 1.0}
    os.makedirs(tmp_path / "data")
    for index in range(3):
        Image.new("RGB", (64 + 16 * index, 64), (30 * index, 90, 160)).save(tmp_path / "data" / f"{index}.png")
    handle = enable_cuda_graphs(model, decoder_max_batch_size=4, decoder_max_cache_len=256)
    try:
        with ResultsFile(tmp_path / "r.jsonl") as results:
            config = CaptionConfig(max_new_tokens=3, batch_size=4)
            captioner = Captioner(model, inputs, config, LoadLimits())
            captioner.run(discover([tmp_path / "data"]), Outputs(results, SidecarPolicy()))
        stats = handle.stats()
    finally:
        handle.disable()
    assert len(read_records(tmp_path / "r.jsonl")) == 3
    assert stats["generate_fallbacks"] == {} and stats["decoder"]["sequences"] == 3


def test_the_help_tells_what_each_family_says_of_an_option():
    """The command line's help is built before a model is chosen: the registry gathers each
    family's phrases (`models/<family>/help.py`, no torch), and the app's own help names no family.
    A family explains each resolution option it reads, and only those."""
    assert set(FAMILY_FOLDERS) == {family.adapter.__module__.split(".")[2] for family in families()}
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["caption"].format_help().split())
    for option in ("max_image_tokens", "max_tiles", "max_frame_tokens", "video_fps", "prompt"):
        phrases = option_help(option)
        assert phrases and all(" ".join(phrase.split()) in text for phrase in phrases), option
    assert len(option_help("max_tiles")) == 2 and option_help("no_such_option") == []
    from importlib import import_module

    resolution = {"max_image_tokens", "max_tiles", "max_frame_tokens"}
    for family in families():
        folder = family.adapter.__module__.split(".")[2]
        said = set(import_module(f"encoder_graphs.models.{folder}.help").HELP) & resolution
        assert said == set(family.inputs.resolution_arguments), folder
