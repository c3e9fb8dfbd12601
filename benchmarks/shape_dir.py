"""Make a ``random:DIR`` model directory (docs/benchmarks.md, "At a model's shape without its weights").

Usage::

    python benchmarks/shape_dir.py benchmarks/shapes/llama-3.1-8b.json OUT [--tokenizer DIR] [--tiny]

Writes ``OUT/config.json`` (the shape) and a tokenizer: ``--tokenizer DIR``'s files when given (e.g. a
model directory holding ``tokenizer.json``), else, offline, a word-level tokenizer of the bench's prose
(every word of ``kvfold/evaluate/data/haystack.txt`` one id, ids within the shape's vocabulary). With
random weights the answers mean nothing either way; a context is as many tokens whichever tokenizer
cuts it. ``--tiny`` keeps the architecture and vocabulary and shrinks every width and the depth (a CPU
run of the GPU script end to end).
"""

from __future__ import annotations

import argparse
import json
import shutil
from importlib import resources
from pathlib import Path

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
"""The widths and depth ``--tiny`` gives a shape."""


def write_word_tokenizer(out: Path, vocab_size: int) -> int:
    """A word-level tokenizer of the bench's prose into ``out`` (no download); returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = resources.files("kvfold.evaluate.data").joinpath("haystack.txt").read_text(encoding="utf-8")
    pre = pre_tokenizers.Whitespace()
    words = dict.fromkeys(word for word, _ in pre.pre_tokenize_str(text))
    words.update(
        dict.fromkeys(
            ["Repeat", "the", "previous", "context", "exactly", ".", ":", "?", "!", ",", "Question", "Answer"]
        )
    )
    vocab = {"[UNK]": 0}
    for word in words:
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(out)
    return len(vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", type=Path, help="a config.json of the architecture (benchmarks/shapes/)")
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--tokenizer", type=Path, default=None, help="copy the tokenizer files of this directory")
    parser.add_argument("--tiny", action="store_true", help="shrink every width and the depth")
    args = parser.parse_args()
    config = json.loads(args.shape.read_text(encoding="utf-8"))
    if args.tiny:
        config.update(TINY)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if args.tokenizer is not None:
        names = [p for p in args.tokenizer.iterdir() if p.name.startswith("tokenizer") or p.name.startswith("chat_")]
        if not any(p.name == "tokenizer.json" for p in names):
            raise SystemExit(f"{args.tokenizer} holds no tokenizer.json")
        for path in names:
            shutil.copy(path, args.out / path.name)
        print(f"{args.out}: {args.shape.name}, the tokenizer of {args.tokenizer}")
        return
    size = write_word_tokenizer(args.out, int(config["vocab_size"]))
    print(f"{args.out}: {args.shape.name}{' (tiny)' if args.tiny else ''}, a word-level tokenizer of {size} words")


if __name__ == "__main__":
    main()
