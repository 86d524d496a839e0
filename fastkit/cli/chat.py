"""``fastkit chat``: talk to a trained model from the terminal, through the chat template it was trained with.

    fastkit chat --model OUTPUT/lora                  # interactive: one line per turn, the history kept
    fastkit chat --model OUTPUT/lora --prompt "Hi"    # one answer, then exit

``--model`` is a folder ``save_lora`` wrote (its base loaded, the adapter on it, the tokenizer and chat
template saved beside it), a merged folder, or a ``.gguf`` file (run by llama.cpp through llama-cpp-python,
``fastkit-llm[llamacpp]``, with the chat template embedded in the file). Greedy unless ``--temperature``.
Interactive commands: ``/reset`` forgets the conversation, ``/exit`` (or an end of input, Ctrl-D) quits.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

Answer = Callable[[list[dict]], str]


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``fastkit chat`` on the ``sub`` subparsers of the main command."""
    p = sub.add_parser("chat", help="chat with a trained model (LoRA folder, merged folder or GGUF)",
                       description="Chat with a saved model through the chat template it was trained with.")
    p.add_argument("--model", required=True, help="OUTPUT/lora, OUTPUT/merged_16bit, or a .gguf file")
    p.add_argument("--prompt", default=None, help="answer this one message and exit (default: interactive)")
    p.add_argument("--system", default=None, help="a system message before the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0 samples")
    p.add_argument("--max-seq-length", type=int, default=2048, help="the context to load the model with")
    p.add_argument("--image", default=None, metavar="PATH", help="not in fastkit chat yet (text only): a "
                   "vision-language model answers an image prompt from Python, docs/vision.md")
    p.set_defaults(run=run)
    return p


def _hf_answer(args: argparse.Namespace) -> Answer:
    from fastkit.cli.export import load_saved
    from fastkit.export import chat

    model, tokenizer, _ = load_saved(args.model, args.max_seq_length)
    stream = sys.stdout.isatty()

    def answer(messages: list[dict]) -> str:
        return chat(model, tokenizer, messages, max_new_tokens=args.max_new_tokens, stream=stream,
                    temperature=args.temperature or None)

    answer.streams = stream
    return answer


def _gguf_answer(args: argparse.Namespace) -> Answer:
    from fastkit.errors import FastkitError
    from fastkit.export.gguf import llamacpp

    try:
        llamacpp.require("a GGUF")
    except FastkitError as exc:
        raise FastkitError(f"fastkit chat --model {args.model}: {exc} Or chat with the LoRA / merged folder instead."
                           ) from None
    # without llama.cpp's extra CPU buffer types: they crash on virtualised Xeons (Note: [portable llama.cpp])
    llm = llamacpp.load(args.model, "fastkit chat", n_ctx=args.max_seq_length, seed=0)

    def answer(messages: list[dict]) -> str:
        out = llm.create_chat_completion(messages=messages, max_tokens=args.max_new_tokens,
                                         temperature=args.temperature)  # 0: greedy; template from the file
        return (out["choices"][0]["message"]["content"] or "").strip()

    answer.streams = False
    return answer


def _answerer(args: argparse.Namespace) -> Answer:
    from fastkit.errors import FastkitError

    path = Path(args.model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FastkitError(f"fastkit chat --model {args.model}: no such file.")
        return _gguf_answer(args)
    return _hf_answer(args)


def _start(args: argparse.Namespace) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def _reply(answer: Answer, messages: list[dict]) -> str:
    text = answer(messages)
    if not getattr(answer, "streams", False):  # a streamer printed it already, and its newline
        print(text, flush=True)
    return text


def interactive(answer: Answer, args: argparse.Namespace) -> None:
    """One user line per turn, answered with the whole conversation so far."""
    print(f"fastkit chat: {args.model}. /reset forgets the conversation, /exit or Ctrl-D quits.", flush=True)
    messages = _start(args)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        if line in ("/exit", "/quit", "exit", "quit"):
            return
        if line == "/reset":
            messages = _start(args)
            print("(conversation reset)")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        print("model> ", end="", flush=True)
        messages.append({"role": "assistant", "content": _reply(answer, messages)})


def run(args: argparse.Namespace) -> int:
    """``fastkit chat`` with parsed ``args``."""
    from fastkit.errors import FastkitError

    if args.max_new_tokens <= 0:
        raise FastkitError(f"--max-new-tokens must be positive, got {args.max_new_tokens}.")
    if args.image is not None:  # before any model loads
        raise FastkitError(f"fastkit chat --image {args.image}: not supported yet (fastkit chat sends text only). "
                           "From Python, a vision-language model loaded with FastModel.from_pretrained(..., "
                           "vision=True) answers an image prompt through its processor: "
                           "processor.apply_chat_template([{'role': 'user', 'content': [{'type': 'image', 'path': "
                           "PATH}, {'type': 'text', 'text': ...}]}], add_generation_prompt=True, tokenize=True, "
                           "return_dict=True, return_tensors='pt'), then model.generate(**inputs).")
    answer = _answerer(args)
    if args.prompt is not None:
        _reply(answer, _start(args) + [{"role": "user", "content": args.prompt}])
        return 0
    interactive(answer, args)
    return 0


__all__ = ["add_parser", "interactive", "run"]
