"""The one error a trainer reports to its operator: the message says what to do."""

from agentstream.schemas.errors import ServiceError


class TrainerError(ServiceError):
    pass


class RanksFailed(TrainerError):
    """A rank of a sharded update died or failed: the step is void; the service restarts the ranks."""
