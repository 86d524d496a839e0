"""The offline quickstart: the CLI smoke-runs on a twin; the real run teaches SmolLM2 a visible format."""

import json

import pytest

from fastkit.cli import main
from fastkit.quickstart import QuickstartConfig, run


def test_cli_quickstart_on_twin(tmp_path, caplog):
    assert main(["quickstart", "--twin", "--steps", "3", "--output-dir", str(tmp_path)]) == 0
    assert "loss per step" in caplog.text and "before:" in caplog.text and "after:" in caplog.text


def test_cli_rejects_unknown_bench():
    with pytest.raises(SystemExit):
        main(["bench", "warp-drive"])


@pytest.mark.slow
def test_real_quickstart_changes_the_answers(tmp_path):
    """SmolLM2-135M-Instruct from the PyPI GGUF: 20 LoRA steps turn prose answers into JSON."""
    result = run(QuickstartConfig(output_dir=str(tmp_path / "out")))
    assert len(result.losses) == 20
    assert result.losses[-1] < result.losses[0] / 3
    as_json = 0
    for prompt, answer in result.after.items():
        assert answer != result.before[prompt]
        try:
            as_json += isinstance(json.loads(answer), dict)
        except json.JSONDecodeError:
            pass
    assert as_json >= 2, result.after
    assert result.steps_per_s > 0 and result.tokens_per_s > 0 and result.peak_memory_gib > 0
