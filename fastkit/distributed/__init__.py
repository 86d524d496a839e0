"""Several processes: one run over several GPUs (or CPU processes), whoever started them.

    ranks.py      which process this is, and ``agreed``: a step every rank runs (or only the main one), whose
                  failure on any rank ends every rank with that rank's error; the main process reports
    launcher.py   ``fastkit.launch(train_fn, num_processes=2)``: the processes from a notebook (accelerate's
                  ``notebook_launcher``)

The DDP / FSDP2 settings of a run are the trainer's (:mod:`fastkit.training.run`); ``torchrun`` and
``accelerate launch`` start ``fastkit train`` itself. ``fastkit.ranks`` and ``fastkit.launcher`` are the old paths
of these modules (served by ``fastkit._MOVED``).
"""

from fastkit.distributed import ranks  # standard library only at import (torch and accelerate inside its functions)

__all__ = ["ranks"]
