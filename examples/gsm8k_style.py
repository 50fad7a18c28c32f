"""GSM8K-style word problems in verl's parquet layout, generated here (no download).

    python -m examples.gsm8k_style OUT_DIR [--train 512] [--test 64] [--seed 0]

writes OUT_DIR/train.parquet and OUT_DIR/test.parquet with verl's columns, as
verl's examples/data_preprocess/gsm8k.py lays GSM8K out:

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + instruction}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<the number>"}
    extra_info    {"split": "train" | "test", "index": i, "answer": "<worked solution
                  ending in '#### <number>'>", "question": question}

Questions are one or two arithmetic steps about everyday quantities, short
enough for the tiny demo model's 128 positions with the short instruction;
examples/rewards/gsm8k.py scores the answers.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Final

DATA_SOURCE: Final = "openai/gsm8k"
# verl's instruction, and a short one for a model with a small context.
INSTRUCTION: Final = 'Let\'s think step by step and output the final answer after "####".'
SHORT_INSTRUCTION: Final = "End with #### N."
_NAMES: Final = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay")
_THINGS: Final = ("apples", "pens", "cards", "eggs", "books")


def problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked solution ending in '#### n', n)."""
    who, what = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(2, 20), rng.randint(2, 9)
    if rng.random() < 0.5:
        n = a + b
        return (f"{who} has {a} {what} and gets {b} more. How many now?",
                f"{a} + {b} = {n}\n#### {n}", n)
    n = a * b
    return (f"{who} buys {b} bags of {a} {what}. How many {what}?",
            f"{b} * {a} = {n}\n#### {n}", n)


def rows(count: int, *, split: str, seed: int, instruction: str = INSTRUCTION,
         ) -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}/{split}")
    out = []
    for index in range(count):
        question, solution, n = problem(rng)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(n)},
            "extra_info": {"split": split, "index": index, "answer": solution,
                           "question": question},
        })
    return out


def write(out_dir: Path, *, train: int, test: int, seed: int = 0,
          instruction: str = INSTRUCTION) -> dict[str, Path]:
    """train.parquet and test.parquet under `out_dir` (test omitted when 0)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, count in (("train", train), ("test", test)):
        if count:
            path = out_dir / f"{split}.parquet"
            pq.write_table(pa.Table.from_pylist(
                rows(count, split=split, seed=seed, instruction=instruction)), path)
            written[split] = path
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--test", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true",
                        help=f"the short instruction ({SHORT_INSTRUCTION!r}) for a small model")
    args = parser.parse_args()
    for split, path in write(args.out_dir, train=args.train, test=args.test, seed=args.seed,
                             instruction=SHORT_INSTRUCTION if args.short else INSTRUCTION
                             ).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
