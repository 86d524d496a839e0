"""``fastkit plan --gpus N [--fsdp]``: the per-GPU peak of DDP and FSDP2 (fastkit/plan/multi.py), checked against a
hand computation from the counts in fastkit/plan/shapes.json; one GPU is the plan of before, byte for byte."""

import hashlib
import json
from pathlib import Path

import pytest

from fastkit.cli import main
from fastkit.errors import FastkitError
from fastkit.plan import plan
from fastkit.plan.multi import DDP_BUCKETS, GATHERED, LAYER_GRADS
from fastkit.units import GiB

MODEL = "Qwen/Qwen3-14B"
SHAPE = json.loads((Path(__file__).parents[1] / "fastkit/plan/shapes.json").read_text())[MODEL]

# Before --gpus existed (commit 6bad6ca): the predicted peak in bytes and the sha256 of `Plan.table()`.
ONE_GPU = {
    ("t4", True): (15255213342, "78ca8731a0f77e6f"),
    ("t4", False): (36463452241, "b6403858fec9275b"),
    ("a100-80", False): (35557482577, "8c8e28748fa010c5"),
    ("rtx-24g", True): (14349243678, "6cc4df2b89bb3251"),
}


@pytest.mark.parametrize("gpu,four_bit", list(ONE_GPU))
def test_one_gpu_is_the_plan_of_before(gpu, four_bit):
    total, digest = ONE_GPU[gpu, four_bit]
    default = plan(MODEL, gpu=gpu, load_in_4bit=four_bit)
    one = plan(MODEL, gpu=gpu, load_in_4bit=four_bit, gpus=1, fsdp=False)
    assert one.components == default.components and one.advice == default.advice
    assert one.total == total
    assert hashlib.sha256(one.table().encode()).hexdigest()[:16] == digest


def hand_fsdp2_qwen3_14b_t4() -> dict[str, int]:
    """Qwen3-14B, 2 x T4, FSDP2, LoRA r=16, 16-bit weights (fp16 on a T4: 2 bytes), AdamW 32-bit, 2,048 tokens."""
    n, size, r = 2, 2, 16
    linear, embed, other = SHAPE["linear_params"], SHAPE["embedding_params"], SHAPE["other_params"]
    assert (linear, embed, other) == (13_212_057_600, 1_555_824_640, 424_960)
    lora = sum(r * (i + o) * copies for i, o, _, copies in SHAPE["lora_dims"])
    # q, o: 5120 <-> 5120; k, v: 5120 -> 1024; gate, up: 5120 -> 17408 (x 80 = 2 per layer x 40), down: 17408 -> 5120
    assert lora == 16 * (6144 * 80 + 10240 * 80 + 22528 * 80 + 22528 * 40) == 64_225_280
    layers = SHAPE["layers"]
    layer = (linear * size + other * size) / layers + (lora // layers) * 4  # 660,624,128 + 6,422,528 bytes
    return {
        "weights: linear layers, float16, sharded 1/2": linear * size // n,  # 13,212,057,600
        "weights: embeddings + lm_head, float16, sharded 1/2": embed * size // n,  # 1,555,824,640
        "weights: norms, router, other, float16, sharded 1/2": other * size // n,  # 424,960
        "LoRA r=16: parameters + gradients (fp32), sharded 1/2": lora * 8 // n,  # 256,901,120
        "optimizer state (adamw_torch), sharded 1/2": lora * 8 // n,  # 256,901,120
        GATHERED: embed * size + 2 * int(layer),  # root kept gathered + the computing and the prefetched layer
        LAYER_GRADS: (lora // layers) * 4,  # 6,422,528
    }


def test_fsdp2_terms_against_a_hand_computation(capsys):
    hand = hand_fsdp2_qwen3_14b_t4()
    two = plan(MODEL, gpu="t4", gpus=2, fsdp=True)
    one = plan(MODEL, gpu="t4")
    for name, nbytes in hand.items():
        assert two.components[name] == nbytes, name
    assert hand[GATHERED] == 3_111_649_280 + 2 * 667_046_656
    activations = {k: v for k, v in one.components.items() if not k.startswith(("weights", "LoRA", "optimizer",
                                                                                  "CUDA", "allocator"))}
    assert activations and all(two.components[k] == v for k, v in activations.items())  # per GPU, unchanged
    in_allocator = sum(hand.values()) + sum(v for k, v in activations.items() if not k.startswith("(not at"))
    assert two.components["allocator slack (8%)"] == int(0.08 * in_allocator)
    assert two.total == in_allocator + int(0.6 * GiB) + int(0.08 * in_allocator)
    assert two.single == one.total
    assert main(["plan", MODEL, "--gpus", "2", "--fsdp"]) == 1  # 2 x T4 at 16 bits: still too big
    out = capsys.readouterr().out
    for name, nbytes in hand.items():
        assert f"| {name} | {nbytes / GiB:.2f} |" in out
    assert f"One GPU: predicted {one.total / GiB:.2f} GiB, does NOT fit; 2 GPUs with FSDP2: " \
           f"{two.total / GiB:.2f} GiB per GPU, does NOT fit." in out


def test_ddp_is_a_full_copy_plus_the_gradient_buckets():
    one = plan(MODEL, gpu="a100-80")
    two = plan(MODEL, gpu="a100-80", gpus=2)
    lora = 64_225_280
    assert two.components[DDP_BUCKETS] == lora * 4
    assert {k: v for k, v in two.components.items() if k not in (DDP_BUCKETS, "allocator slack (8%)")} == \
        {k: v for k, v in one.components.items() if k != "allocator slack (8%)"}


def test_one_gpu_does_not_fit_but_n_do(capsys):
    result = plan(MODEL, gpu="rtx-24g")  # 16-bit Qwen3-14B: about 34 GiB on one
    assert not result.fits
    n, fsdp, total = result.across
    assert (n, fsdp) == (2, True) and total <= result.budget
    assert plan(MODEL, gpu="rtx-24g", gpus=2, fsdp=True).total == total
    assert main(["plan", MODEL, "--gpu", "rtx-24g"]) == 1
    assert "Across GPUs: 2 x rtx-24g with FSDP2 fit" in capsys.readouterr().out
    assert main(["plan", MODEL, "--gpu", "rtx-24g", "--gpus", "2", "--fsdp"]) == 0
    assert "does NOT fit; 2 GPUs with FSDP2" in capsys.readouterr().out


def test_fsdp_needs_two_gpus():
    with pytest.raises(FastkitError, match="gpus=2 or more"):
        plan(MODEL, gpus=1, fsdp=True)
    with pytest.raises(FastkitError, match="gpus must be a positive int"):
        plan(MODEL, gpus=0)
