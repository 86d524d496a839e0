"""``fastkit train`` checks and tokenizes each text row once: make_trainer's check (fastkit.data.prepare) measures the
rows it tokenizes for TRL, and the command hands it the rows as read (no check of its own before)."""

from __future__ import annotations

import collections
import json

from fastkit import cli

ROWS = 12


def test_fastkit_train_tokenizes_each_text_row_once(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i:02d}: a short line of text to train on."}) + "\n"
                            for i in range(ROWS)))
    seen: collections.Counter = collections.Counter()
    real = PreTrainedTokenizerBase.__call__

    def counting(self, text=None, *args, **kwargs):  # every tokenizer call, with the rows its texts come from
        texts = [text] if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else []
        seen.update(i for t in texts if isinstance(t, str) for i in range(ROWS) if f"row {i:02d}:" in t)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counting)
    rc = cli.main(["train", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", str(data),
                   "--steps", "1", "--max-seq-length", "128", "--lora-r", "4", "--output-dir", str(tmp_path / "run")])
    assert rc == 0
    assert dict(seen) == dict.fromkeys(range(ROWS), 1), seen  # each row tokenized once, none skipped
