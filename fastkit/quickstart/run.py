"""Running the quickstart end to end: load, ask, LoRA, train under the dashboard, ask again.

Runs on a 2-core CPU in a few minutes, on a GPU in seconds. Same steps as
``notebooks/00_quickstart.ipynb``: load -> ask -> LoRA -> SFTTrainer (packing on) -> ask again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fastkit import checks
from fastkit.device import GiB
from fastkit.export import chat, save_lora
from fastkit.loader import FastModel
from fastkit.quickstart.data import quickstart_dataset, score
from fastkit.quickstart.weights import smollm2_135m_instruct
from fastkit.training import fit, make_trainer

logger = logging.getLogger(__name__)


@dataclass
class QuickstartConfig:
    """Knobs of the quickstart run; the defaults finish in under 5 minutes on 2 CPU cores."""

    max_steps: int = 20
    """Optimizer steps."""
    max_seq_length: int = 256
    """Tokens per packed row (several short examples share a row)."""
    batch_size: int = 1
    """Packed rows per step."""
    learning_rate: float = 2e-3
    """LoRA learning rate: high, because 20 steps must visibly teach a format. Safe for the facts because the
    training answers only wrap the model's own kind of sentence in JSON (see :mod:`fastkit.quickstart.data`)."""
    lora_r: int = 16
    """LoRA rank."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Linear layers that get LoRA adapters."""
    output_dir: str = "outputs/quickstart"
    """Where the LoRA adapters are saved (``<output_dir>/lora``) after training."""
    twin: bool = False
    """Use a tiny random twin instead of the real weights (CI smoke runs)."""


@dataclass
class QuickstartResult:
    """What the quickstart measured."""

    before: dict[str, str] = field(default_factory=dict)
    """Held-out question -> the base model's answer."""
    after: dict[str, str] = field(default_factory=dict)
    """Held-out question -> the answer after training."""
    losses: list[float] = field(default_factory=list)
    steps_per_s: float = 0.0
    """Optimizer steps per second after warm-up (the dashboard's number)."""
    tokens_per_s: float = 0.0
    """Training tokens per second after warm-up."""
    peak_memory_gib: float = 0.0
    seconds: float = 0.0
    adapters: str = ""
    """The folder the trained LoRA adapters were saved to (``<output_dir>/lora``)."""
    weights: str | None = None
    """The cached converted SmolLM2 folder (a plain transformers checkpoint), None for a twin run."""

    @property
    def format_before(self) -> int:
        """Held-out answers in the trained JSON format, before training."""
        return score(self.before)[0]

    @property
    def format_after(self) -> int:
        """Held-out answers in the trained JSON format, after training."""
        return score(self.after)[0]

    @property
    def facts_before(self) -> int:
        """Held-out answers stating the right fact (e.g. Tokyo), before training."""
        return score(self.before)[1]

    @property
    def facts_after(self) -> int:
        """Held-out answers stating the right fact, after training."""
        return score(self.after)[1]

    def scores(self) -> str:
        """``format x/N, facts y/N`` before -> after, on the held-out questions."""
        n = len(self.before)
        return (f"held-out ({n} questions): format {self.format_before}/{n} -> {self.format_after}/{n}, "
                f"facts {self.facts_before}/{n} -> {self.facts_after}/{n} (before -> after)")

    def summary(self) -> str:
        lines = [f"loss per step: {' '.join(f'{x:.2f}' for x in self.losses)}",
                 f"{self.steps_per_s:.2f} steps/s, {self.tokens_per_s:.0f} tokens/s (after warm-up), peak memory "
                 f"{self.peak_memory_gib:.2f} GiB, {self.seconds:.0f} s in all", self.scores()]
        for prompt in self.before:
            lines += [f"Q: {prompt}", f"  before: {self.before[prompt]}", f"  after:  {self.after[prompt]}"]
        if self.adapters:
            lines.append(f"LoRA adapters saved in {self.adapters}")
        if self.weights:
            lines.append(f"SmolLM2-135M-Instruct weights cached in {self.weights}; train on it again: fastkit train "
                         f"--model {self.weights} --data sample (or --data your_chats.jsonl)")
        return "\n".join(lines)


def run(config: QuickstartConfig | None = None, view: str = "auto") -> QuickstartResult:
    """Run the quickstart end to end and return its measurements.

    ``view``: the dashboard to train under (``"auto"``: widget in a notebook, progress line elsewhere).
    """
    config = config or QuickstartConfig()
    start = time.perf_counter()
    checks.check_save_target(config.output_dir, "output_dir")  # before the model loads
    weights = None if config.twin else str(smollm2_135m_instruct())
    model, tokenizer = FastModel.from_pretrained(weights or "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                 max_seq_length=config.max_seq_length, twin=config.twin)
    train, heldout = quickstart_dataset()
    result = QuickstartResult(weights=weights)
    result.before = {p: chat(model, tokenizer, p, max_new_tokens=48, stream=False) for p in heldout}
    model = FastModel.get_peft_model(model, r=config.lora_r, lora_alpha=config.lora_r,
                                     target_modules=list(config.target_modules), use_gradient_checkpointing=False)
    trainer = make_trainer(model, tokenizer, train, max_steps=config.max_steps, learning_rate=config.learning_rate,
                           batch_size=config.batch_size, max_seq_length=config.max_seq_length,
                           output_dir=config.output_dir)
    trainer.update_record(resume_hint=None)  # a demo: Ctrl-C goes on to the answers after, nothing to resume
    metrics = fit(trainer, view=view, title="fastkit quickstart")
    result.losses = [loss for _, loss in metrics.loss_history]
    result.steps_per_s = metrics.steps_per_s or 0.0
    result.tokens_per_s = metrics.tokens_per_s or 0.0
    result.after = {p: chat(model, tokenizer, p, max_new_tokens=48, stream=False) for p in heldout}
    result.peak_memory_gib = metrics.peak_memory / GiB
    result.adapters = str(save_lora(model, tokenizer, f"{config.output_dir}/lora"))
    result.seconds = time.perf_counter() - start
    logger.info("fastkit quickstart:\n%s", result.summary())
    return result


__all__ = ["QuickstartConfig", "QuickstartResult", "run"]
