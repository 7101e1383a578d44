"""The one error a trainer reports to its operator: the message says what to do."""


class TrainerError(RuntimeError):
    pass
