"""The benchmarks' shared layer: one device rule for --gpu, quick runs never write into assets/, one formatter."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastkit.bench import common
from fastkit.cli import main as cli_main
from fastkit.errors import GPUOnlyError

BENCHES = ["packed", "offload", "moe", "sft"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("name", BENCHES)
def test_gpu_without_cuda_raises_before_any_work(name, no_cuda, tmp_path):
    module = importlib.import_module(f"fastkit.bench.{name}")
    with pytest.raises(GPUOnlyError, match="--gpu needs a CUDA GPU"):
        module.main(["--gpu", "--quick", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", BENCHES)
def test_cli_prints_the_gpu_error_and_exits_2(name, no_cuda, capsys):
    assert cli_main(["bench", name, "--gpu"]) == 2
    err = capsys.readouterr().err
    assert "--gpu needs a CUDA GPU" in err and "Traceback" not in err


def test_device_is_cpu_without_gpu_flag():
    assert common.bench_device(False) == torch.device("cpu")


def test_quick_runs_never_write_into_assets(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = common.write_outputs("demo", "| a |\n|---|\n| 1 |\n", quick=True)
    assert not (tmp_path / common.ASSETS).exists() and path.exists() and path.name == "bench_demo.md"
    assert tmp_path not in path.parents
    assert f"written: {path}" in capsys.readouterr().out
    shutil.rmtree(path.parent)
    given = common.write_outputs("demo", "x\n", quick=True, out=tmp_path / "given")
    assert given == tmp_path / "given" / "bench_demo.md"
    full = common.write_outputs("demo", "x\n")
    assert full == Path(common.ASSETS) / "bench_demo.md"


def test_one_byte_formatter_and_one_table_renderer():
    assert common.fmt_bytes(3 * 2**29) == "1.50 GiB" and common.fmt_bytes(12 * 2**20) == "12.0 MiB"
    assert common.fmt_bytes(24 * 1024) == "24.0 KiB" and common.fmt_bytes(512) == "512 B"
    assert common.fmt_bytes(16 * 1024, "MiB") == "0.0 MiB" and common.fmt_bytes(0) == "0"
    assert common.fmt_bytes(None, unknown="n/a (CPU)") == "n/a (CPU)"
    table = common.markdown_table(["name", "ms"], [["a", 1.5], ["b", 2]], align="lr")
    assert table == "| name | ms |\n|---|---:|\n| a | 1.5 |\n| b | 2 |\n"


def test_every_bench_parses_the_shared_arguments():
    for name in BENCHES:
        module = importlib.import_module(f"fastkit.bench.{name}")
        with pytest.raises(SystemExit) as info:
            module.main(["--help"])
        assert info.value.code == 0


def test_python_dash_m_fastkit_is_the_command():
    out = subprocess.run([sys.executable, "-m", "fastkit", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage: fastkit" in out.stdout and "quickstart" in out.stdout and "bench" in out.stdout
