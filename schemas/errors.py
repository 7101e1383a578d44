"""The errors agentstream raises, in one tree: catch a kind, or the base for all of them.

Every message says what went wrong and what to do about it; the CLI prints it as one line
instead of a traceback. Each kind also derives from the builtin exception it used to be, so
`except ValueError` / `except LookupError` / `except RuntimeError` around older code still holds.

* AgentstreamError
  * ConfigurationError (ValueError) - a setting, flag, argument or file that cannot work as given
    * controller.tasks.TaskFileError, recipes.swe.tasks.InstanceFileError, dashboard.rollouts.FilterError,
      streams.rewards.RewardError, agentstream.logs.replay.ReplayError, agentstream.logs.results.QueryFailed
      (a query polars refuses), schemas.flags.BadSetting (a flag or variable an entrypoint refuses, exit 2),
      releases.manual.NoCanary (a promote or rollback of a model with no canary running)
  * LogUnavailable (LookupError) - Kafka or the archive cannot serve what was asked: unreachable,
    no such topic, an unreadable archive manifest
    * controller.controller.KafkaUnavailable
  * DecodeError (ValueError) - bytes that are not what they claim to be
    * UnsupportedSchemaVersion - an event written by a newer agentstream
    * schemas.tokens.InvalidToken - a rollout token that does not verify
    * schemas.conversation.BadConversation - a request's conversation that is not one (the gateway's 400)
  * ServiceError (RuntimeError) - a part of the platform could not do its job while running
    * trainer.errors.TrainerError (and CheckpointLocked, RanksFailed), controller.controller.RunLocked,
      controller.attempt.LaunchError, sandbox.contract.SandboxError,
      agentstream.stack.StackError, gateway.pool_sync.UpdateFailed, recipes.swe: GradeError,
      BuildError, EnvError, WorkspaceError, RepoError, SandboxExhausted
  * schemas.api_errors.ApiError - an error a client gets as an HTTP response (OpenAI's shape): the dashboard's
    * gateway.errors.GatewayError - the gateway's
"""

from __future__ import annotations


class AgentstreamError(Exception):
    """The base of every error agentstream raises on purpose; its message names the fix."""


class ConfigurationError(AgentstreamError, ValueError):
    """A setting, flag, argument or file that cannot work as given."""


class LogUnavailable(AgentstreamError, LookupError):
    """Kafka or the archive cannot serve what was asked (unreachable, no such topic, unreadable)."""


class DecodeError(AgentstreamError, ValueError):
    """The bytes are not what they claim to be (an event this version understands, a valid token)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnsupportedSchemaVersion(DecodeError):
    """An event written by a newer agentstream: deadletter it rather than guess at its meaning."""


class ServiceError(AgentstreamError, RuntimeError):
    """A part of the platform could not do its job while running (a server, a sandbox, a build)."""
