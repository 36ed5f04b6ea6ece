"""The caption run's settings: plain Python, so the command line can check them before it loads
torch or a model."""

from dataclasses import dataclass

DEFAULT_PROMPT = "Describe this in one sentence."


@dataclass(frozen=True)
class CaptionConfig:
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 32
    batch_size: int = 8
    max_batch_tokens: int = 16384  # vision placeholder tokens in one generate call
    load_workers: int = 4

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ValueError("prompt must not be empty")
        for name in ("max_new_tokens", "batch_size", "max_batch_tokens", "load_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
