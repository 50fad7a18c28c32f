"""A byte-level BPE tokenizer trained here, on text this module generates.

A model of a real architecture (trainer/architectures.py) needs a tokenizer of
the kind real models ship: byte-level BPE (GPT-2's byte alphabet, so that
every string encodes without an unknown token), merges learnt from text,
special tokens for the chat format.  Nothing may be downloaded, so the text
is generated, deterministically:

    the built-in task     every digit string of its prompts and answers
    English               sentences from a small grammar and lexicon
    math                  sums, products and short word problems whose answer
                          follows "####" (the GSM8K convention)
    names                 pseudo-words built from syllables, as many as the
                          vocabulary asks for: merges beyond the real words of
                          the text need new material (a 150 k vocabulary, the
                          size of Qwen2's, merges them into whole-word tokens)

Pre-tokenization splits text into words with their leading space,
punctuation runs, whitespace and single digits: numbers are read digit by
digit (as Qwen2 and Llama 3 do), so the built-in task's answers are one token
per digit whatever the merges.

    train_bpe(vocab_size, special_tokens) -> tokenizers.Tokenizer
        same arguments, same tokenizer (byte for byte in to_str())
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any, Final

CORPUS_SEED: Final = 20261126
# Sentences of each generated kind; enough for every merge of a small vocabulary
# (1-4 k) to come from real words and numbers.
SENTENCES: Final = 3000
# Each pseudo-word appears this many times: a merge needs a pair seen at least
# MIN_FREQUENCY times, so every pseudo-word can become one token.
NAME_REPEATS: Final = 2
MIN_FREQUENCY: Final = 2
# The smallest vocabulary that holds the byte alphabet and some merges.
MIN_VOCAB: Final = 300
# Words with their leading space, one digit, punctuation runs, line breaks,
# other whitespace: each a pre-token that merges never cross.
PRE_TOKEN_PATTERN: Final = (
    r"[^\S\n]?\p{L}+|\p{N}|[^\S\n]?[^\s\p{L}\p{N}]+|\n+|[^\S\n]+"
)

_SUBJECTS: Final = ("the robot", "a student", "my neighbour", "the old teacher", "a farmer",
                    "the little cat", "our team", "the scientist", "a baker", "the pilot",
                    "she", "he", "they", "we", "the model")
_VERBS: Final = ("reads", "counts", "builds", "finds", "carries", "paints", "measures",
                 "writes", "reverses", "sorts", "checks", "sells", "buys", "shares", "adds")
_ADJECTIVES: Final = ("small", "large", "red", "blue", "quiet", "bright", "heavy", "new",
                      "simple", "strange", "careful", "green", "warm", "cold", "long")
_NOUNS: Final = ("apples", "books", "numbers", "boxes", "stones", "letters", "answers",
                 "bridges", "songs", "pencils", "questions", "lists", "coins", "maps",
                 "digits")
_PLACES: Final = ("in the garden", "at school", "before noon", "after dinner", "by the river",
                  "on the table", "every morning", "in the city", "near the station",
                  "during the test")
_CONNECTIVES: Final = ("and then", "because", "while", "but", "so", "although", "before")
_ITEMS: Final = ("apples", "marbles", "cookies", "pencils", "stickers", "books", "eggs",
                 "coins", "cards", "flowers")
_PEOPLE: Final = ("Sara", "Tom", "Ali", "Mei", "Lena", "Omar", "Ivan", "Ada", "Noah", "Priya")
_ONSETS: Final = ("", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
                  "z", "br", "st", "tr", "kl", "sh", "ch")
_VOWELS: Final = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS: Final = ("", "", "n", "r", "s", "l", "k", "m")


def _sentence(rng: random.Random) -> str:
    def clause() -> str:
        return (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.randint(2, 99)} "
                f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_PLACES)}")

    text = clause()
    if rng.random() < 0.5:
        text += f" {rng.choice(_CONNECTIVES)} {clause()}"
    end = rng.choice((".", ".", "!", "?"))
    return text[0].upper() + text[1:] + end


def _math(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    kind = rng.randrange(4)
    if kind == 0:
        return f"{a} + {b} = {a + b}"
    if kind == 1:
        return f"{a} * {b % 20} = {a * (b % 20)}"
    if kind == 2:
        return f"What is {max(a, b)} - {min(a, b)}? The answer is {max(a, b) - min(a, b)}."
    who, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    more = b % 50
    return (f"{who} has {a % 100} {item}. {who} buys {more} more {item}. How many {item} "
            f"does {who} have now?\n{who} has {a % 100} + {more} = {a % 100 + more} {item}."
            f"\n#### {a % 100 + more}")


def _reverse_lines() -> Iterator[str]:
    """The built-in task's prompts and answers (rollout/tasks.py), all of them."""
    from rollout.tasks import REVERSE_MAX_DIGITS, REVERSE_MIN_DIGITS, reverse_prompt

    for length in range(REVERSE_MIN_DIGITS, REVERSE_MAX_DIGITS + 1):
        step = max(1, 10 ** length // 2000)  # every digit string of 2-3 digits, a sample above
        for n in range(0, 10 ** length, step):
            digits = str(n).zfill(length)
            yield f"{reverse_prompt(digits)}{digits[::-1]}"


def _name(rng: random.Random) -> str:
    syllables = rng.randint(2, 4)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables))


def corpus(vocab_size: int, *, seed: int = CORPUS_SEED) -> Iterator[str]:
    """The training text, line by line: the same arguments give the same lines."""
    rng = random.Random(seed)
    yield from _reverse_lines()
    roles = ("system", "user", "assistant")
    for i in range(SENTENCES):
        # A third of the lines open with a chat role, as rendered conversations do.
        yield (f"{roles[i % 9 // 3]}\n" if i % 3 == 0 else "") + _sentence(rng)
        yield _math(rng)
    names: set[str] = set()
    while len(names) < vocab_size:
        names.add(_name(rng))
    ordered = sorted(names)
    rng.shuffle(ordered)
    for _ in range(NAME_REPEATS):
        # Each after a space, so every occurrence is the same pre-token (" name").
        for start in range(0, len(ordered), 8):
            yield "Names: " + " ".join(ordered[start:start + 8]) + "."


def train_bpe(vocab_size: int, special_tokens: Sequence[str], *, normalizer: Any = None,
              pre_tokenizer: Any = None) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens, the
    `special_tokens` first (ids 0, 1, ...).  `normalizer` and `pre_tokenizer` replace
    the default (none; PRE_TOKEN_PATTERN then bytes) where the loader of an
    architecture imposes its own.  Raises ValueError when the vocabulary is too
    small for the byte alphabet or when the text cannot fill it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = MIN_VOCAB + len(special_tokens)
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} is below {floor}: a byte-level BPE holds "
                         f"256 byte tokens, {len(special_tokens)} special tokens and some "
                         "merges; give at least that many")
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(vocab_size), trainer=trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise ValueError(f"the generated text gave {got} tokens, not vocab_size={vocab_size}: "
                         "the corpus has too few distinct pairs left to merge; give a "
                         "vocabulary of at most that size")
    return tokenizer
