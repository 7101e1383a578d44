"""Who demonstrates (`--teacher`), and which of a teacher's graded attempts are kept for the SFT set."""

from __future__ import annotations

import dataclasses
import re

from pydantic import BaseModel

from agentstream.schemas.events import Trajectory

EXPERT = "expert"
_UPSTREAM = re.compile(r"^(?P<model>[A-Za-z0-9][\w.:/-]*)=(?P<url>https?://[^\s@]+)$")


@dataclasses.dataclass(frozen=True)
class Upstream:
    """A teacher served behind an OpenAI-compatible URL: the gateway routes `model` there."""

    model: str
    url: str


def parse_teacher(text: str) -> Upstream | None:
    """`expert` (None: the scripted expert) or `MODEL=URL`; anything else is a ValueError that says the forms."""
    if text == EXPERT:
        return None
    if match := _UPSTREAM.match(text.strip()):
        return Upstream(match["model"], match["url"].rstrip("/"))
    raise ValueError(f"--teacher takes 'expert' or 'MODEL=URL' (a server speaking vLLM's OpenAI API, e.g. "
                     f"big=http://127.0.0.1:8001; its key in an environment variable named by --teacher-key-env, "
                     f"never in the URL), not {text!r}")


class Keep(BaseModel):
    """Which of the teacher's attempts are imitated."""

    min_reward: float = 1.0
    flagged: bool = False
    """keep attempts the grader flagged (tests or git history touched)"""
    max_tokens: int = 0
    """the most tokens its answers may hold together; 0: any"""

    def verdict(self, trajectory: Trajectory, flagged: bool) -> str | None:
        """Why the attempt is left out, or None when it is kept."""
        generated = sum(len(turn.completion_token_ids) for turn in trajectory.turns)
        if trajectory.reward is None:
            return "ungraded"
        if trajectory.reward < self.min_reward:
            return f"reward {trajectory.reward:g} below {self.min_reward:g}"
        if flagged and not self.flagged:
            return "flagged by the grader"
        if self.max_tokens and generated > self.max_tokens:
            return f"{generated} generated tokens, more than {self.max_tokens}"
        if not trajectory.turns:
            return "no model call"
        return None
