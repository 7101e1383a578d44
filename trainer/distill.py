"""On-policy distillation's teacher: a vLLM server that scores the student's own sampled tokens.

    batch ─▶ each sequence's token ids as the prompt of one /v1/completions call to the teacher
        (prompt_logprobs 0, max_tokens 1) ─▶ log p_teacher(token t | tokens < t) for every t ≥ 1
        ─▶ Sample.teacher_logprobs, aligned with the sequence's token_ids as its recorded logprobs are
        ─▶ grpo.distillation_advantages: −(log p_student − log p_teacher) on the generated tokens

vLLM answers `prompt_logprobs: 0` with the logprob of each prompt token itself (plus the top 0 others),
whatever its rank, computed from the raw logits (no temperature). The prompt is token ids, never text, so
nothing is tokenized twice: the teacher must share the student's tokenizer (a bigger model of the same
family), and a token id outside its vocabulary is its 400, said as this trainer's error. Prompts, tool
outputs and the harness's text are scored too (one call per sequence is cheaper than cutting it), but only
the generated tokens' scores are used (the loss mask).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from agentstream.trainer.batcher import Sample
from agentstream.trainer.errors import TrainerError
from agentstream.trainer.settings import TrainerSettings


class TeacherError(TrainerError):
    """The teacher did not score a sequence: unreachable, refused it, or answered something else."""


class Teacher:
    """The teacher's server, as a client that scores token sequences."""

    def __init__(self, settings: TrainerSettings, timeout_s: float = 300.0):
        key = settings.distill_teacher_api_key.get_secret_value()
        self.url = settings.distill_teacher_url.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.url, timeout=timeout_s,
                                        headers={"Authorization": f"Bearer {key}"} if key else {})
        self.model = settings.distill_teacher_model
        self.limit = asyncio.Semaphore(settings.distill_concurrency)

    async def close(self) -> None:
        await self.client.aclose()

    async def served_model(self) -> str:
        """The model name to ask for: the one set, else the first the server lists."""
        if not self.model:
            models = (await self._post_or_get("GET", "/v1/models", None)).get("data")
            if not isinstance(models, list) or not models:
                raise TeacherError(f"the teacher at {self.url} serves no model (/v1/models is empty)")
            self.model = str(models[0]["id"])
        return self.model

    async def score(self, token_ids: list[int]) -> list[float]:
        """log p_teacher(token t | tokens < t) for each position t of `token_ids` (0.0 at t = 0, which has no
        context)."""
        if len(token_ids) < 2:
            return [0.0] * len(token_ids)
        body = {"model": await self.served_model(), "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 0}
        async with self.limit:
            answer = await self._post_or_get("POST", "/v1/completions", body)
        try:
            scored = answer["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError) as exc:
            raise TeacherError(f"the teacher at {self.url} answered without prompt_logprobs ({exc!r}): is it vLLM?") \
                from exc
        if not isinstance(scored, list) or len(scored) != len(token_ids):
            raise TeacherError(f"the teacher scored {len(scored) if isinstance(scored, list) else 'no'} positions of "
                               f"a {len(token_ids)}-token sequence")
        logprobs = [0.0]
        for position, (entry, token) in enumerate(zip(scored[1:], token_ids[1:]), start=1):
            found = entry.get(str(token)) if isinstance(entry, dict) else None
            if found is None:
                raise TeacherError(f"the teacher's scores of position {position} do not name its token {token}")
            logprobs.append(float(found["logprob"]))
        return logprobs

    async def score_samples(self, samples: list[Sample], max_len: int) -> float:
        """Score every sequence of every sample (cut to `max_len`, as the trainer cuts it) into
        `Sample.teacher_logprobs`; the seconds it took."""
        started = time.perf_counter()
        sequences = [(sample, seq.token_ids[:max_len]) for sample in samples for seq in sample.trajectory.sequences]
        scores = await asyncio.gather(*(self.score(tokens) for _, tokens in sequences))
        for sample in samples:
            sample.teacher_logprobs = []
        for (sample, _), logprobs in zip(sequences, scores):
            assert sample.teacher_logprobs is not None  # set above
            sample.teacher_logprobs.append(logprobs)
        return time.perf_counter() - started

    async def _post_or_get(self, method: str, path: str, body: dict[str, object] | None) -> dict[str, Any]:
        try:
            response = await self.client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise TeacherError(f"the teacher at {self.url} did not answer {path}: {exc!r}") from exc
        if response.status_code != 200:
            raise TeacherError(f"the teacher at {self.url} answered {path} with {response.status_code}: "
                               f"{response.text[:500]}")
        answer = response.json()
        if not isinstance(answer, dict):
            raise TeacherError(f"the teacher at {self.url} answered {path} with no JSON object")
        return answer
