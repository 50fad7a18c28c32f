"""A GSM8K reward in verl's form: give it to every node as reward.path.

    [reward]
    path = "examples/rewards/gsm8k.py"     # function = "compute_score", the default

The answer is the number after the last "####" in the response, as GSM8K's
reference solutions and verl's instruction put it ("output the final answer
after ####"); it is right when it equals the ground truth as a number
("1,000" and "1000.0" are 1000).  Besides the score, the dict reports
`formatted` (the response has a "#### number" at all) and `acc`, which the
aggregation averages into the iteration's metrics as reward/formatted and
reward/acc; `pred`, a string, is ignored there.  Nothing here imports the
coordinator: the file runs in a worker process of its own.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str) -> str | None:
    """The number after the last "####", commas dropped; None without one."""
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Any = None) -> dict[str, Any]:
    pred = extract_answer(solution_str)
    answer, truth = _number(pred or ""), _number(str(ground_truth))
    correct = answer is not None and truth is not None and answer == truth
    return {"score": 1.0 if correct else 0.0, "acc": correct, "formatted": pred is not None,
            "pred": pred or ""}
