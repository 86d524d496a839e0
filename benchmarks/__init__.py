"""fastkit's benchmarks: baseline and fastkit side by side in one process, reporting ratios.

Not part of the wheel: run them from a clone, ``python -m benchmarks {packed,offload,moe,sft} --out DIR``
(``fastkit bench ...`` is the same from a clone). A full run writes ``bench_<name>.md`` (+ ``.png``) only
into ``--out``; ``--quick`` without ``--out`` writes to a temp folder.

    common.py     shared CLI arguments, device rule, timing, noise, tables, output
    packed.py     packed-sequence training: transformers vs fastkit
    offload.py    checkpoint-reload strategies and the time model
    moe.py        one MoE experts layer: transformers' paths vs fastkit's (+ moe_4bit.py: 4-bit experts)
    sft.py        the same LoRA SFT run, plain vs fastkit
    data.py       reading and preparing a chat dataset: plain datasets + TRL vs fastkit (time, peak RSS)
"""

NAMES = ("packed", "offload", "moe", "sft", "data")
