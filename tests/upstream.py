"""Run fastkit's upstream-facing tests against other releases of transformers / TRL / PEFT than the installed ones.

A fresh install takes the newest release pyproject.toml admits, so each of transformers, trl and peft is bounded
below the next minor nobody has checked (``transformers>=5.24,<5.26``). CI runs the whole suite on what a fresh
install resolves (the ceiling) and, with this script, the upstream-facing files on the floor of every range
(``--floor``: the lowest release each lower bound admits). To check a new release before admitting it, see
docs/upstream.md; in short::

    python tests/upstream.py transformers==5.26.0        # install it beside the venv, run the files below on it

The releases go into ``.cache/upstream/<spec>`` with ``pip install --no-deps --target`` and shadow the installed
ones through ``PYTHONPATH`` (the venv's own packages stay as they are); the exit code is pytest's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("transformers", "trl", "peft")
"""The ranges that get an upper bound and a floor run: the upstream code fastkit reaches into (fastkit/_hf/)."""
FILES = ("tests/test_hf_compat.py", "tests/test_packing_varlen.py", "tests/test_packing_state.py",
         "tests/test_census.py", "tests/test_moe_lora.py", "tests/test_sft_config.py", "tests/test_loader.py")
"""Every accessor of fastkit._hf, the stateful-layer and varlen paths, the family census (packing / MoE parity per
family), PEFT on experts, every SFTConfig flag, the loader. The rest of the patch tests already run on transformers'
floor with torch's floor (tests/gpu/rehearse.sh)."""


def floor_specs(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """``name==X`` for each of :data:`PACKAGES` from its ``>=X`` in pyproject.toml (``5.24`` -> ``5.24.0``)."""
    text = pyproject.read_text()
    specs = []
    for name in PACKAGES:
        match = re.search(rf'"{name}>=([0-9.]+),<([0-9.]+)"', text)
        if match is None:
            raise SystemExit(f"pyproject.toml: {name} needs a range '>=X,<Y' (an upper bound at the newest checked "
                             "minor); see docs/upstream.md")
        low = match.group(1)
        specs.append(f"{name}=={low}.0" if low.count(".") == 1 else f"{name}=={low}")
    return specs


def install(specs: list[str]) -> Path:
    """``specs`` installed (no dependencies) into one folder under .cache/upstream; reused when already there."""
    target = ROOT / ".cache" / "upstream" / "+".join(sorted(specs))
    stamp = target / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "--target", str(target), *specs], check=True)
        stamp.write_text("\n".join(specs) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="*", help="releases to test, e.g. transformers==5.26.0")
    parser.add_argument("--floor", action="store_true", help="the lowest release of each range in pyproject.toml")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: passed to pytest")
    args = parser.parse_args(argv)
    named = {re.split(r"[=<>!~]", spec, maxsplit=1)[0] for spec in args.specs}
    specs = [s for s in floor_specs() if s.split("==")[0] not in named] + args.specs if args.floor else args.specs
    if not specs:
        parser.error("name a release (transformers==X.Y.Z) or --floor")
    target = install(specs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", "import transformers, trl, peft; print('upstream: transformers', "
                    "transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)"],
                   env=env, cwd=ROOT, check=True)
    extra = [a for a in args.pytest_args if a != "--"]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES, *extra],
                          env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
