"""On a CUDA GPU: the dashboard's memory numbers come from torch (mem_get_info, allocator stats), not NVML."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_gpu_memory_fields_and_syncs(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from fastkit import FastModel
    from fastkit.dashboard import MetricsCallback, memory_rows
    from fastkit.families.twins import twin, twin_tokenizer

    tok = twin_tokenizer()
    model = twin("qwen3", num_hidden_layers=2).cuda()
    FastModel.patch(model, max_seq_length=128, patches=None)
    rows = [{"messages": [{"role": "user", "content": f"{a} plus {a}?"},
                          {"role": "assistant", "content": str(2 * a)}]} for a in range(32)]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, bf16=False, fp16=False,
                     report_to=[], logging_steps=100, save_strategy="no", max_length=128, disable_tqdm=True,
                     gradient_checkpointing=False)
    cb = MetricsCallback(warmup_steps=1, measure_syncs=True)
    SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
               callbacks=[cb]).train()
    m = cb.metrics
    mem = m.memory
    assert m.status == "finished" and mem.device.startswith("cuda")
    assert mem.allocated > 0 and mem.reserved >= mem.allocated
    assert m.peak_memory >= mem.allocated
    assert mem.total == torch.cuda.mem_get_info(mem.device)[1]
    rows = memory_rows(m)
    assert rows["gpu_memory"].label == "GPU allocated / reserved"
    assert rows["gpu_peak"].label == "GPU peak allocated / reserved / total"
    assert m.peak_reserved >= m.peak_memory > 0   # torch.cuda.max_memory_reserved: what predicts an OOM
    # TRL reads its per-step metrics back (.item()), so a whole step has host syncs, and they were counted
    assert m.syncs_per_step is not None and m.syncs_per_step > 0
    assert m.steps_per_s is not None and m.tokens_per_s is not None
