"""Character-level tokenizer of the tiny model, stored as a standard ``tokenizer.json``.

One token per character: printable ASCII (space to ``~``) and ``\\n``, plus the special
tokens ``<pad>`` (id 0), ``<|endoftext|>`` (id 1, end of sequence) and ``<unk>`` (id 2).
Every character is split off by the pre-tokenizer and the ``Fuse`` decoder joins tokens
without separators, so ``decode(encode(s)) == s`` for any ASCII ``s``.

Load it with :func:`load_tokenizer` (``PreTrainedTokenizerFast.from_pretrained``):
``AutoTokenizer`` on a ``qwen2``-type model directory returns Qwen2's byte-level tokenizer
and ignores a custom ``tokenizer.json``.

The chat template renders the message contents back to back with no role markers, so the
``chat`` and ``plain`` prompt templates give the same short prompt for the tiny task.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = tuple(chr(i) for i in range(32, 127)) + ("\n",)
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first (pad 0, eos 1, unk 2), then the characters."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character-level ``PreTrainedTokenizerFast`` (not yet saved)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(build_vocab(), unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    """Save the tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) into ``model_dir``."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(model_dir))
    return tokenizer


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer of a tiny model directory (offline; never touches the hub)."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"load_tokenizer: {path}/tokenizer.json not found; "
            "create the tiny model with `armor tiny --out DIR` and pass DIR/model"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
