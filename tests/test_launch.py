"""``fastkit.launch``: accelerate's notebook_launcher on 2 CPU processes (gloo), as a notebook would call it, run in a
fresh interpreter (the launcher forks it), and in a real Jupyter kernel with the function defined in a cell. Not
tested: GPUs (Kaggle's 2 x T4), NCCL."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    env.pop("FASTKIT_DASHBOARD", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_launch_runs_a_function_on_two_processes_and_returns_rank0s_result(tmp_path):
    proc = _python("import fastkit\nfrom tests.dist.launch_fns import ranks_seen\n"
                   "print('DDP', fastkit.launch(ranks_seen, 10, num_processes=2))\n"
                   "print('FSDP', fastkit.launch(ranks_seen, 0, num_processes=2, fsdp=True))\n"
                   "print('ONE', fastkit.launch(ranks_seen, 5, num_processes=1))", ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "DDP (0, 2, 21.0, None)" in out  # rank 0 of 2; (0 + 10) + (1 + 10) over gloo
    assert "FSDP (0, 2, 1.0, 'true')" in out
    assert "ONE (0, 1, 5.0, None)" in out  # one process: called here, no process group


def test_launch_refuses_after_accelerate_state_was_made(tmp_path):
    proc = _python("import fastkit\nfrom fastkit import ranks\nranks.state()\n"
                   "from tests.dist.launch_fns import ranks_seen\nfastkit.launch(ranks_seen, 0, num_processes=2)", ROOT)
    assert proc.returncode != 0
    assert "fastkit.launch: accelerate's state was already made in this notebook" in proc.stderr, proc.stderr[-2000:]


def test_a_failing_process_is_named_with_what_it_raised(tmp_path):
    """A refusal inside train_fn reaches the notebook as one FastkitError naming the process and the message (not
    torch's ChildFailedError page); any other error keeps torch's report (with the traceback) as its cause."""
    code = ("import fastkit\nfrom tests.dist.launch_fns import refuse_on_rank1\n"
            "try:\n    fastkit.launch(refuse_on_rank1, {kind!r}, num_processes=2)\n"
            "except Exception as e:\n    print('CAUGHT', type(e).__name__, '|', e, '|', type(e.__cause__).__name__)\n")
    ours = _python(code.format(kind="fastkit"), ROOT)
    assert "CAUGHT FastkitError | fastkit.launch: process 1 raised FastkitError: fastkit failure on rank 1 | " \
           "NoneType" in ours.stdout, (ours.stdout + ours.stderr)[-3000:]
    bug = _python(code.format(kind="bug"), ROOT)
    assert "CAUGHT FastkitError | fastkit.launch: process 1 raised ZeroDivisionError: bug failure on rank 1 | " \
           "ChildFailedError" in bug.stdout, (bug.stdout + bug.stderr)[-3000:]


@pytest.mark.slow
def test_launch_trains_with_one_dashboard_and_one_save(tmp_path):
    proc = _python(f"import fastkit\nfrom tests.dist.launch_fns import train_twin\n"
                   f"print('RESULT', fastkit.launch(train_twin, {str(tmp_path)!r}, num_processes=2))", ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "RESULT ('finished', 2)" in out
    for line in ("fastkit: new run", "training finished", "save_lora verified"):
        assert out.count(line) == 1, (line, out[-3000:])
    assert "effective batch 2" in out
    assert (tmp_path / "lora/adapter_model.safetensors").is_file()


TRAIN_CELL = '''def train(out, fsdp):
    from fastkit import FastModel, ranks
    from fastkit.data.samples import NO_ROBOTS_SAMPLE
    from fastkit.data.sources import load_sources
    from fastkit.export import save_lora
    from fastkit.export.sharded import save_sharded_lora
    from fastkit.training import fit, make_trainer

    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model)
    trainer = make_trainer(model, tok, load_sources(str(NO_ROBOTS_SAMPLE)), max_steps=2, max_seq_length=128,
                           output_dir=f"{out}/run", drop_long=True, save_steps=None)
    metrics = fit(trainer)
    if fsdp:
        save_sharded_lora(model, tok, f"{out}/lora")
    else:
        ranks.agreed(save_lora, model, tok, f"{out}/lora", main_only=True)
    return metrics.status'''


@pytest.mark.slow
def test_launch_from_a_jupyter_kernel_with_a_function_defined_in_a_cell(tmp_path):
    """What a Kaggle notebook does: ``train`` defined in a cell (forked into each process, not pickled), DDP then
    FSDP2 from the same kernel, each trained and saved once; the kernel's cells print rank 0's results."""
    import nbformat

    from tests.test_notebooks import _client, _kernel_env

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "import fastkit", TRAIN_CELL,
        f"print('DDP', fastkit.launch(train, {str(tmp_path / 'ddp')!r}, False, num_processes=2))",
        f"print('FSDP', fastkit.launch(train, {str(tmp_path / 'fsdp')!r}, True, num_processes=2, fsdp=True))")]
    env = {k: v for k, v in _kernel_env().items() if k != "FASTKIT_TWIN"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("FASTKIT_DASHBOARD", raising=False)
        _client(nb, tmp_path).execute()
    ddp, fsdp = ("".join(o.get("text", "") for o in nb.cells[i].outputs) for i in (2, 3))
    assert "DDP finished" in ddp and ddp.count("save_lora verified") == 1, ddp[-3000:]
    assert "2 processes (DDP)" in ddp and ddp.count("training finished") == 1, ddp[-3000:]
    assert "FSDP finished" in fsdp and fsdp.count("save_lora verified (FSDP)") == 1, fsdp[-3000:]
    for run in ("ddp", "fsdp"):
        assert (tmp_path / run / "lora/adapter_model.safetensors").is_file()
