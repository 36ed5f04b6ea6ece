"""The caption run's job: every value the run derives from the flags, the files and the model,
resolved once into one frozen object that the run reads and nothing downstream derives again.

`open_job` resolves what the model's files decide, before its weights load (a usage error then
costs no GBs): the prompt (the model's where none was given), the load limits (frame counts,
resolutions, decoder threads), the longest sequence (checked against the model's positions).
`sized_job` resolves, once the weights are on the device, what their memory decides: the
batches and vision-token caps of each kind of file, and the graph options (`GraphOptions`,
compile included) handed to `enable_cuda_graphs`. `JOB_SOURCES` names the one function that
sets each field; a test holds the code to it."""

import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from encoder_graphs.app.config import COMPILE_FROM_FILES, CaptionConfig
from encoder_graphs.app.model_checks import check_length, check_resolution_flags, check_seeded_sampling, load_limits
from encoder_graphs.app.plan import Plan

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from encoder_graphs import GraphOptions
    from encoder_graphs.app.decoders import VideoDecoders
    from encoder_graphs.app.loading import ModelSource
    from encoder_graphs.app.media import LoadLimits


@dataclass(frozen=True)
class CaptionJob:
    """What one caption run reads. `config`: the prompt, generation settings, and (once sized)
    the batches and token caps of each kind of file; `limits`: how files are read; `lengths`: the
    longest sequence of the job and of its images (they size the decoder's cache, its tiers and
    the batches); `options`: the graphs' settings (None until sized)."""

    device: "torch.device"
    model_name: str  # as the records and the statistics name it
    config: CaptionConfig
    limits: "LoadLimits"
    longest: int
    longest_image: int  # the longest sequence of an image (a job of videos: their prompts are longer)
    options: "GraphOptions | None" = None


# Each field of the job and the one function that sets it (`tests/test_job.py` checks the code).
JOB_SOURCES = {
    "device": "open_job",
    "model_name": "open_job",
    "config": "open_job",  # the prompt; its batches and token caps: sized_job, by `batched_config`
    "limits": "open_job",
    "longest": "open_job",
    "longest_image": "open_job",
    "options": "sized_job",
}


def open_job(plan: Plan, source: "ModelSource", device: "torch.device") -> CaptionJob:
    """The job as the model's files decide it, before the weights load: flags the family does not
    read, the prompt, the load limits, the lengths against the model's positions, seeded sampling;
    a usage error for any of them."""
    settings = plan.settings
    check_resolution_flags(settings, source.inputs)
    config = plan.config.with_prompt_of(source.inputs.default_prompt)  # e.g. an OCR model's
    limits = load_limits(plan, source, config.load_workers, device)
    longest, longest_image = check_length(plan, config, source, limits)
    check_seeded_sampling(settings, source)
    return CaptionJob(device=device, model_name=settings.model or "default", config=config, limits=limits,
                      longest=longest, longest_image=longest_image)


def sized_job(job: CaptionJob, plan: Plan, model: "PreTrainedModel", videos: "VideoDecoders | None" = None) -> CaptionJob:
    """The job with what the weights' memory decides: its batches (`batched_config`) and the
    graphs' options. `videos`: the video decoders started while the model loaded; the sizing
    waits for their workers' CUDA contexts (NVDEC's) and counts those made (`wait_started`)."""
    from encoder_graphs import GraphOptions

    config = batched_config(job, plan, model, videos.wait_started() if videos is not None else 0)
    settings = plan.settings
    options = GraphOptions(
        budgets=settings.budgets,
        attn_backend=settings.attn_backend,
        enabled=not settings.no_graphs,
        compile=wants_compile(plan, job.device),
        max_frames_per_item=job.limits.max_frames,
        decoder_max_batch_size=config.largest_batch * (len(config.named) or 1),  # a row a file's prompt
        decoder_max_cache_len=job.longest,
        lazy=True,  # each graph at its first use: a job captures only what it needs
        encoder_capture_from_call=2,  # and an encoder budget only once a second batch wants it
    )
    return replace(job, config=config, options=options)


def nvdec_bytes_later(job: CaptionJob, videos: int, worker_contexts: int) -> int:
    """GPU bytes NVDEC's decoder workers will take after the batches are sized, where they decode
    this job's videos: a decoder each, and a CUDA context each but the `worker_contexts` made
    already (none where the pool starts after the sizing: a Ray actor's, one the API's Captioner
    starts at its first video)."""
    from encoder_graphs.app.decoders import video_workers
    from encoder_graphs.app.nvdec import CONTEXT_GPU_BYTES, DECODER_GPU_BYTES

    if job.limits.video_hwaccel != "nvdec" or not videos:
        return 0
    workers = video_workers(job.config.load_workers)
    return workers * DECODER_GPU_BYTES + max(0, workers - worker_contexts) * CONTEXT_GPU_BYTES


def batched_config(job: CaptionJob, plan: Plan, model: "PreTrainedModel", worker_contexts: int = 0) -> CaptionConfig:
    """The job's CaptionConfig with its batches: per kind of file, at most what the GPU memory free
    holds beside the one cache `job.longest` sizes, and never more than the job's files of that
    kind (the decoder then captures no larger bucket). Images and videos batch apart: a video's
    prompt does not shrink the photos' batches."""
    from encoder_graphs.app.sizing import fitting_batch_sizes

    settings, new_tokens = plan.settings, job.config.max_new_tokens
    by_kind = plan.todo_by_kind()
    counts = {kind: by_kind[kind] for kind in ("image", "video")}
    prompts = {"image": job.longest_image - new_tokens}
    if counts["video"]:
        prompts["video"] = job.longest - new_tokens
        if not counts["image"]:
            del prompts["image"]  # no photo rows in the cache
    requested = settings.batch_size
    # With named prompts a file is a row a prompt: memory sizes rows, a batch counts files.
    per = len(job.config.named) or 1
    most = {kind: max(1, counts[kind]) for kind in prompts}
    rows = fitting_batch_sizes(requested and requested * per, model, job.longest, prompts,
                               {kind: n * per for kind, n in most.items()}, job.device,
                               held_later=nvdec_bytes_later(job, counts["video"], worker_contexts))
    sizes = {kind: max(1, n // per) for kind, n in rows.items()}
    for kind, fit in rows.items():
        if fit < per:  # one file is the least a batch holds: its prompts' rows may not fit
            print(f"encoder-graphs: the GPU memory free holds {fit} sequences of {kind}s, fewer than the {per} prompts "
                  "of one file: a batch may run out of memory (fewer prompts, or a lower resolution)", file=sys.stderr)
    for kind, size in sizes.items():
        if requested is not None and size < min(requested, most[kind]):
            print(f"encoder-graphs: --batch-size {requested} capped to {size} for {kind}s: the GPU memory free holds "
                  f"{size} sequences of up to {prompts[kind] + new_tokens} tokens beside the cache", file=sys.stderr)
    # Unless given, the vision-token cap lets a batch of the largest items through: the batch
    # size already counts their memory.
    tokens = {kind: settings.max_batch_tokens or prompts[kind] * size for kind, size in sizes.items()}
    return replace(
        job.config,
        batch_size=sizes.get("image", 1),
        max_batch_tokens=tokens.get("image", settings.max_batch_tokens or job.config.max_batch_tokens),
        video_batch_size=sizes.get("video"),
        video_max_batch_tokens=tokens.get("video"),
        prefetch_batches=1 if plan.job.distributed else job.config.prefetch_batches,
    )


def wants_compile(plan: Plan, device: "torch.device") -> bool:
    """`--compile` / `--no-compile`, else on a GPU with enough files to pay for it: compiling the
    encoder blocks, MLPs, norms and decode layers adds tens of seconds to the start and, beside
    our kernels and graphs, saves little of the loop, so it pays only on large jobs
    (COMPILE_FROM_FILES; measured: benchmarks/RESULTS.md). With `--no-graphs` too: the compiled blocks speed the eager
    path as much."""
    if plan.settings.compile is not None:
        return plan.settings.compile
    return device.type == "cuda" and plan.todo_by_kind().total() >= COMPILE_FROM_FILES * plan.job.world_size

