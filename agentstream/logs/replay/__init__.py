"""Replay: a range of the log into the trainer, into a rebuilt trajectories topic, or into a dataset.

`run.replay` drives it; `rebuild` remakes trajectories from the raw topics with the streams
worker's own fold (`parallel`: in several processes, by partition); `sinks` write and resume the
output; `state` is the resume file. `request` makes a job of the operator's flags; `report` runs one
on a terminal, with a progress bar and a summary.
"""

from agentstream.logs.replay.rebuild import RebuildSpec
from agentstream.logs.replay.run import Job, Options, Progress, RangeSpec, Summary, default_state, replay
from agentstream.logs.replay.selection import Selection, parse_rollouts, parse_versions
from agentstream.logs.replay.state import ReplayError

__all__ = ["Job", "Options", "Progress", "RangeSpec", "RebuildSpec", "ReplayError", "Selection", "Summary",
           "default_state", "parse_rollouts", "parse_versions", "replay"]
