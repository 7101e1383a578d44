"""Who demonstrates (`--teacher`), and which of a teacher's graded attempts are kept for the SFT set."""

from __future__ import annotations

import dataclasses
import re

from pydantic import BaseModel

EXPERT = "expert"
_UPSTREAM = re.compile(r"^(?P<model>[A-Za-z0-9][\w.:/-]*)=(?P<url>https?://[^\s@]+)$")


@dataclasses.dataclass(frozen=True)
class Upstream:
    """A teacher served behind an OpenAI-compatible URL (vLLM, or a provider: OpenAI, Anthropic's OpenAI-compatible
    endpoint): the gateway routes `model` there as a provider, forwarding its calls as they are."""

    model: str
    url: str


def parse_teacher(text: str) -> Upstream | None:
    """`expert` (None: the scripted expert) or `MODEL=URL`; anything else is a ValueError that says the forms."""
    if text == EXPERT:
        return None
    if match := _UPSTREAM.match(text.strip()):
        return Upstream(match["model"], match["url"].rstrip("/"))
    raise ValueError(f"--teacher takes 'expert' or 'MODEL=URL' (a server speaking OpenAI's chat completions, e.g. "
                     f"big=http://127.0.0.1:8001 or gpt-4.1=https://api.openai.com; its key in an environment variable "
                     f"named by --teacher-key-env, never in the URL), not {text!r}")


@dataclasses.dataclass(frozen=True)
class Attempt:
    """What the filter reads of one of the teacher's graded attempts."""

    reward: float | None
    flagged: bool
    """the grader flagged its diff (tests or git history touched)"""
    answers: list[str]
    """the text of each of its model calls that was answered, in order"""
    generated_tokens: int
    """as its server counted them (usage), or its token ids where the gateway recorded them"""


class Keep(BaseModel):
    """Which of the teacher's attempts are imitated."""

    min_reward: float = 1.0
    flagged: bool = False
    """keep attempts the grader flagged (tests or git history touched)"""
    max_tokens: int = 0
    """the most tokens its answers may hold together; 0: any"""

    def verdict(self, attempt: Attempt) -> str | None:
        """Why the attempt is left out, or None when it is kept."""
        if attempt.reward is None:
            return "ungraded"
        if attempt.reward < self.min_reward:
            return f"reward {attempt.reward:g} below {self.min_reward:g}"
        if attempt.flagged and not self.flagged:
            return "flagged by the grader"
        if self.max_tokens and attempt.generated_tokens > self.max_tokens:
            return f"{attempt.generated_tokens} generated tokens, more than {self.max_tokens}"
        if not attempt.answers:
            return "no model call"
        return None
