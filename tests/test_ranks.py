"""fastkit.ranks in one process, the CLI's line for another rank's error, and the DDP setting fastkit picks (issue 43).

The multi-process runs (torchrun, gloo): tests/test_distributed.py.
"""

import logging

import pytest

from fastkit.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, _error_line
from fastkit.distributed import ranks
from fastkit.errors import FastkitError
from fastkit.training.options import TrainOptions
from fastkit.training.run import sft_config


def test_plain_run_is_one_main_process():
    assert ranks.is_main() and ranks.world_size() == 1


def test_agreed_in_one_process_just_calls():
    assert ranks.agreed(lambda x: x + 1, 1) == 2
    assert ranks.agreed(lambda: "saved", main_only=True) == "saved"
    with pytest.raises(FastkitError, match="nope"):
        ranks.agreed(lambda: (_ for _ in ()).throw(FastkitError("nope")))


def test_quiet_replicas_leaves_the_main_process_alone():
    log = logging.getLogger("fastkit")
    level = log.level
    ranks.quiet_replicas()
    assert log.level == level


@pytest.mark.parametrize("bad_input, interrupted, status, line", [
    (True, False, EXIT_BAD_INPUT, "--output-dir is a file (rank 1)"),
    (False, False, EXIT_FAILED, "failed: OSError: --output-dir is a file (rank 1)"),
    (False, True, EXIT_INTERRUPTED, "interrupted (rank 1)"),
])
def test_another_ranks_error_ends_this_rank_the_same_way(bad_input, interrupted, status, line):
    kind = "FastkitError" if bad_input else "OSError"
    exc = ranks.OtherRankFailed(1, kind, "output_dir is a file", bad_input, interrupted)
    assert _error_line(exc) == (status, line)


def _config(every_parameter_used: bool, **sft):
    options = TrainOptions(max_steps=2, sft=sft)
    return sft_config(options, evaluate=False, cuda=False, optim="adamw_torch", precision={},
                      every_parameter_used=every_parameter_used)


def test_ddp_skips_the_unused_parameter_search_only_where_fastkit_knows():
    assert _config(True)["ddp_find_unused_parameters"] is False
    assert "ddp_find_unused_parameters" not in _config(False)  # the Trainer's own choice
    assert _config(True, ddp_find_unused_parameters=True)["ddp_find_unused_parameters"] is True  # the user's wins


def test_every_parameter_used_needs_checkpointing_and_no_routing():
    from types import SimpleNamespace

    import torch

    from fastkit.training.run import every_parameter_used

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace()
    assert not every_parameter_used(model)
    model.is_activation_checkpointing = True
    assert every_parameter_used(model)
    model.config.num_experts_per_tok = 2  # an expert no token reached gets no gradient
    assert not every_parameter_used(model)
