"""The one error a trainer reports to its operator: the message says what to do."""

from schemas.errors import ServiceError


class TrainerError(ServiceError):
    pass
