"""Prompt templates: the policy prompt, the hinted policy prompt and the hint-request prompt.

One place for every string the model sees, so the tiny model's warm start, the hint sources and the
trainer agree on the exact format. Level 0 means "no hint" (deployment and evaluation).
"""

from __future__ import annotations

LEVELS = (1, 2, 3)

LEVEL_DESCRIPTIONS = {
    1: "minimal: name the key idea only",
    2: "medium: show the first step",
    3: "detailed: show every step but the last",
}

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

HINT_HEADER = "Here is a hint to help you:"

HINT_REQUEST_TEMPLATE = (
    "You are a tutor. Write a level {level} hint ({description}) for the problem. "
    "Never reveal the final answer.\nProblem: {problem}\nSolution: {solution}"
)


def hinted_problem(problem: str, hint: str | None) -> str:
    """x -> (x, h): the user turn the policy sees. An empty hint gives back the bare problem."""
    if not hint:
        return problem
    return f"{problem}\n{HINT_HEADER}\n{hint}"


def hint_request(problem: str, solution: str, level: int) -> str:
    """The user turn that asks a model (the policy itself, or a teacher) for a level-`level` hint."""
    if level not in LEVEL_DESCRIPTIONS:
        raise ValueError(f"hint level must be one of {LEVELS}, got {level!r}")
    return HINT_REQUEST_TEMPLATE.format(
        level=level, description=LEVEL_DESCRIPTIONS[level], problem=problem, solution=solution
    )


def chat(user: str, system: str | None = None) -> list[dict[str, str]]:
    """A conversational prompt in TRL's format."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return messages
