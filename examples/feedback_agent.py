"""An example agent plugin: two tries at a task, the environment saying whether the first
answer was right.

    coordinator demo --set rollout.agent=examples.feedback_agent:FeedbackAgent

Each episode: the task's prompt (its chat messages, or its text for a model
without a chat format, like the demo's), the model's answer, and, when it is
wrong, the environment's "wrong, try again" (with the prompt again, in text)
and a second answer.  The reward is the task's own (exact match for the demo's
digit reversal): 1 for a right first answer, 0.5 for a right second one.
The conversation is token-exact (rollout/conversation.py), so the trainer
learns from exactly the tokens the model sampled, with the environment's
message and the chat template's tokens between the two answers masked out of
the loss.

A plugin is any class with `run(task, engine) -> Episode` (made with no
arguments) or a function `(task, engine) -> Episode`: docs/PLUGINS.md.
"""

from __future__ import annotations

from rollout.agents import EngineEndpoint
from rollout.episode import Episode
from rollout.rewards import default_reward_for, get_reward
from rollout.tasks import Task


class FeedbackAgent:
    max_tokens = 8
    retry_message = "wrong, try again"

    def run(self, task: Task, engine: EngineEndpoint) -> Episode:
        reward = get_reward(default_reward_for(task.data_source))
        chat = task.messages()
        # Chat tasks through the model's chat template; a plain prompt (the demo's
        # tiny model has no chat format) as text, continued with text.
        conv = engine.conversation(chat or str(task.prompt))
        first = conv.generate(max_tokens=self.max_tokens)
        if reward(first.text, task.ground_truth) == 1.0:
            return Episode(tuple(conv.turns), 1.0)
        if chat:
            conv.add([{"role": "user", "content": self.retry_message}])
        else:
            conv.add(f"\n{self.retry_message}\n{task.prompt}")
        second = conv.generate(max_tokens=self.max_tokens)
        return Episode(tuple(conv.turns), 0.5 * reward(second.text, task.ground_truth))
