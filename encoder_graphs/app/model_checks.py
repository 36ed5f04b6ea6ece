"""What the caption command checks and derives once the model's files are opened, before its
weights load: flags the model's family does not read, the longest sequence against the model's
positions, seeded sampling where the decoder graphs cannot take it, and the load limits."""

from dataclasses import replace
from typing import TYPE_CHECKING

from encoder_graphs.app.config import DEFAULT_PROMPT
from encoder_graphs.app.errors import UsageError, printable
from encoder_graphs.app.plan import Plan
from encoder_graphs.app.settings import Settings

if TYPE_CHECKING:
    import torch

    from encoder_graphs.app.config import CaptionConfig
    from encoder_graphs.app.loading import ModelSource
    from encoder_graphs.app.media import LoadLimits
    from encoder_graphs.protocols import CaptionInputs


def check_resolution_flags(settings: Settings, inputs: "CaptionInputs") -> None:
    """A resolution flag the model's family does not read is a usage error, not ignored."""
    from encoder_graphs.app.config import DEFAULT_FRAME_TOKENS, DEFAULT_IMAGE_TOKENS

    given = {
        "max_tiles": settings.max_tiles is not None,
        "max_image_tokens": settings.max_image_tokens != DEFAULT_IMAGE_TOKENS,
        "max_frame_tokens": settings.max_frame_tokens != DEFAULT_FRAME_TOKENS,
    }
    flags = ", ".join("--" + name.replace("_", "-") for name in inputs.resolution_arguments)
    for name, was_given in given.items():
        if was_given and name not in inputs.resolution_arguments:
            model = printable(settings.model) if settings.model else "the embedded tiny default"
            raise UsageError(f"--{name.replace('_', '-')} does not apply to {model} ({type(inputs).__name__}); "
                             f"its resolution flags: {flags}")


def load_limits(plan: Plan, source: "ModelSource", load_workers: int, device: "torch.device") -> "LoadLimits":
    """What the loaders may read, and how (`LoadLimits`), with the video decoder the job's size
    chooses (`nvdec.chosen`); a usage error where --video-decoder nvdec cannot run here."""
    from encoder_graphs.app import nvdec
    from encoder_graphs.app.decoders import default_decoder_threads, video_workers
    from encoder_graphs.app.media import LoadLimits

    settings, inputs = plan.settings, source.inputs
    runs_here = nvdec.runs_on(device.type)
    if settings.video_decoder == "nvdec" and not runs_here:
        raise UsageError(nvdec.NEEDS)
    videos = plan.videos_to_do() if inputs.reads_videos else 0  # a model of images refuses them undecoded
    decoder = nvdec.chosen(settings.video_decoder, runs_here, videos, plan.job.world_size)
    return LoadLimits(
        max_frames=settings.max_frames,
        video_fps=settings.video_fps,
        video_sampling=settings.video_sampling,
        min_side=inputs.min_side,
        max_pixels=inputs.max_image_pixels,
        frame_max_pixels=inputs.max_frame_pixels,
        frame_size=inputs.frame_size,
        video_timeout_s=settings.video_timeout,
        video_threads=default_decoder_threads(video_workers(load_workers)),
        video_hwaccel="nvdec" if decoder == "nvdec" else None,
        video_device=device.index or 0 if device.type == "cuda" else 0,
    )


def check_length(plan: Plan, config: "CaptionConfig", source: "ModelSource", limits: "LoadLimits") -> tuple[int, int]:
    """The job's longest sequence and its images' (`longest_sequence`, with `config`'s prompt);
    past the model's positions, a usage error naming the flag that makes it so: the caption's
    length, the frames of a video, the prompt, or the images' resolution."""

    inputs = source.inputs
    flag = "--prompt" if plan.settings.prompt_file is None else f"--prompt-file {plan.settings.prompt_file}"
    try:
        longest_image = longest_sequence(inputs, config, limits, videos=False)
        longest = longest_sequence(inputs, config, limits, videos=True) if plan.todo_by_kind()["video"] \
            else longest_image
    except ValueError as error:  # a prompt the model's inputs refuse (DeepSeek-OCR's with its own <image>)
        raise UsageError(f"{flag}: {error}") from error
    positions = getattr(source.config.get_text_config(), "max_position_embeddings", None)
    if positions is None or longest <= positions:
        return longest, longest_image
    prompt = longest - config.max_new_tokens
    image_prompt = longest_image - config.max_new_tokens
    past = f"past the model's {positions} positions"
    if prompt < positions:
        raise UsageError(f"--max-new-tokens {config.max_new_tokens}: the longest prompt ({prompt} tokens) plus the "
                         f"caption reaches {longest} tokens, {past}; at most {positions - prompt}")
    if image_prompt < positions:
        raise UsageError(f"--max-frames {plan.settings.max_frames}: a video's prompt reaches {prompt} tokens, {past}")
    plain = replace(config, prompt=inputs.default_prompt or DEFAULT_PROMPT)
    if longest_sequence(inputs, plain, limits, videos=False) - config.max_new_tokens < positions:
        raise UsageError(f"{flag}: the prompt around the largest image reaches {image_prompt} tokens, {past}")
    flags = " or ".join("--" + name.replace("_", "-") for name in inputs.resolution_arguments if "frame" not in name)
    raise UsageError(f"the prompt around the largest image reaches {image_prompt} tokens, {past}: lower {flags}")


def check_seeded_sampling(settings: Settings, source: "ModelSource") -> None:
    """`--seed` draws each file's tokens from its own generator, which only the decoder graphs
    take: a language model they decline (`DecoderGraphRunner.unsupported`) decodes through stock
    `generate`, which takes none. A usage error before the weights load, not a failed file each."""
    from encoder_graphs.decoder.runner import DecoderGraphRunner

    sampled = settings.seed is not None and settings.temperature > 0
    if sampled and (reason := DecoderGraphRunner.unsupported(source.config)) is not None:
        raise UsageError(f"--seed: this model's language model decodes through stock generate ({reason}), "
                         "which takes no seed a file; sample without --seed")


def longest_sequence(inputs: "CaptionInputs", config: "CaptionConfig", limits: "LoadLimits", videos: bool = True) -> int:
    """The most tokens one sequence can reach here: the longest prompt plus `max_new_tokens`. It
    sizes the decoder graphs' cache and the batch; a decode step reads only the smallest length
    tier holding its batch's sequences, so the size costs memory, not per-step reads. A rare
    longer one (an extreme aspect ratio) runs eagerly. A prompt template is measured with long
    field values (a 64-character name and folder, 5-digit sizes). `videos=False` (a job of images
    only) leaves out the videos, whose many frames would size everything."""
    prompts = config.prompts_for("n" * 64, "f" * 64, 99999, 99999)
    return max(inputs.longest_prompt(prompt, limits.max_frames if videos else 0) for prompt in prompts) + config.max_new_tokens
