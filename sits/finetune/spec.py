"""What a fine-tuning job is: base model, dataset, the adapter's shape, and how long and how fast to train."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sits.engine.lora import TARGETS


class FinetuneSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="the job, and its adapter's name")
    model: str = Field(..., min_length=1, description="the base model (an HF folder or a .gguf file)")
    dataset: str = Field(..., min_length=1, description="a folder of *.jsonl: {\"messages\": [...]} or {\"text\": ...}")
    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    steps: int = Field(100, ge=1, le=1_000_000)
    learning_rate: float = Field(2e-4, gt=0, le=1.0)
    batch_size: int = Field(4, ge=1, le=1024)
    max_len: int = Field(512, ge=8, le=131_072, description="tokens per example at most (longer ones are cut)")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    seed: int = 0
    snapshot_every: int = Field(25, ge=1, description="steps between snapshots (optimizer state included)")
    device: str = Field("cpu", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    serve_into: str | None = Field(None, description="a unit to hot-load the adapter into when the job is done")

    def model_post_init(self, _ctx) -> None:
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"targets: {', '.join(bad) or 'none given'}; choose among {', '.join(TARGETS)}")
