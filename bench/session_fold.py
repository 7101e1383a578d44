"""The session fold's CPU per event against a rollout's, in-process; with `--baseline REV`, before and after.

N conversations (two calls, feedback about the second, the client's end) and N attempts (queued, two calls,
a finish, scored by their task's reward function), each kind folded alone as a rebuild folds the log: in
time order, settling what is due before each event (decode, add, release, settle, record). CPU of the best
of `--passes`, in a process of its own per tree (`bench.replay`'s way): µs per event of each kind and the
session/rollout ratio, the baseline of the same run. With `--baseline REV`, REV's tree (git archive) folds
the same events, in turn with this one's, `--rounds` times: after/before per kind.

    uv run python -m bench.session_fold [--conversations 3000] [--passes 3] [--rounds 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import agentstream.schemas as s
from agentstream.schemas.sessions import session_rollout_id
from bench.report import Report
from bench.streams_assembly import checkout

ROOT = Path(__file__).resolve().parents[1]
FOLD = """
import json, pickle, sys, time
from agentstream.schemas.codec import decode
from agentstream.streams.assembly import Assembly, Timing
kinds = pickle.load(open(sys.argv[1], "rb"))
timing = Timing(settle_ms=1000, reward_grace_ms=30_000, session_idle_ms=1_800_000, feedback_window_ms=600_000)
def fold(raws):
    assembly = Assembly({}, {}, timing)
    def settle(now):
        if hasattr(assembly, "settle_due"):
            return assembly.settle_due(now)
        for rollout_id in assembly.due(now):
            assembly.record(assembly.settle(rollout_id, now))
    began = time.process_time()
    for raw in raws:
        event = decode(raw)
        settle(event.time - 1)
        assembly.add(event, raw, 0)
    settle(2 ** 62)
    assert assembly.counts["trajectories"] * 4 == len(raws), assembly.counts
    return time.process_time() - began
print(json.dumps({kind: min(fold(raws) for _ in range(int(sys.argv[2]))) for kind, raws in kinds.items()}))
"""
"""each kind's fold, by whichever tree is the working directory: CPU seconds of the best of N passes"""


def call(time: int, prompt: list[int], completion: list[int], text: str, **ids: str) -> s.CallEvent:
    return s.CallEvent(time=time, **ids, data=s.Call(
        api="chat.completions", model="tiny", status=200, started_at=time - 5,
        latency_ms=5.0, request={}, response={"choices": [{"index": 0, "message": {"content": text}}]},
        prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-0.5] * len(completion),
        weight_version=0))


def conversation(i: int, start: int) -> list[s.Event]:
    session_id = f"chat-{i}"
    ids = dict(rollout_id=session_rollout_id(session_id), source="bench")
    first = call(start, [1, 2, 3], [4, 5], "45", **ids)
    second = call(start + 10, [1, 2, 3, 4, 5, 6], [7, 8], "78", **ids)
    feedback = s.FeedbackEvent(**ids, time=start + 20, data=s.Feedback(
        session_id=session_id, call_id=second.id, sender="key:bench", thumbs="up"))
    end = s.SessionEndedEvent(**ids, time=start + 30, data=s.SessionEnded(session_id=session_id, sender="key:bench"))
    for event in (first, second):
        event.data.session_id = session_id
    return [first, second, feedback, end]


def attempt(i: int, start: int) -> list[s.Event]:
    ids = dict(rollout_id=f"r-{i}", attempt_id="a1", source="bench")
    task = s.Task(id="t1", input={"prompt": "p"}, reward_fn="streams.rewards:exact_match", metadata={"answer": "78"})
    return [s.RolloutQueuedEvent(**ids, time=start, data=s.RolloutQueued(task=task, group_id="g", model="tiny")),
            call(start + 10, [1, 2, 3], [4, 5], "45", **ids), call(start + 20, [1, 2, 3, 4, 5, 6], [7, 8], "78", **ids),
            s.RolloutFinishedEvent(**ids, time=start + 30, data=s.RolloutFinished(by="controller", exit_code=0))]


def events(n: int) -> dict[str, list[bytes]]:
    """n conversations and n scored attempts, each kind's raw events in time order, 50 ms apart."""
    made = {"session": [e for i in range(n) for e in conversation(i, 1_700_000_000_000 + i * 50)],
            "rollout": [e for i in range(n) for e in attempt(i, 1_700_000_000_000 + i * 50)]}
    return {kind: [s.encode(e) for e in sorted(kind_events, key=lambda e: e.time)] for kind, kind_events in made.items()}


def fold_process(tree: Path, raws: Path, passes: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", FOLD, str(raws), str(passes)], cwd=tree, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"the fold by {tree} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=3000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", help="also fold with the tree of this commit (before)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        raws = Path(folder) / "events.pickle"
        kinds = events(args.conversations)
        raws.write_bytes(pickle.dumps(kinds))
        trees = {"after": ROOT}
        if args.baseline:
            trees = {"before": checkout(args.baseline, Path(folder) / "baseline")[0], **trees}
        report = Report("session_fold", details={"conversations": args.conversations, "baseline_rev": args.baseline})
        for round_ in range(args.rounds):
            cpu = {label: fold_process(tree, raws, args.passes) for label, tree in trees.items()}
            report.details[f"round {round_ + 1}"] = cpu
            for label, spent in cpu.items():
                per_event = {kind: spent[kind] / len(kinds[kind]) * 1e6 for kind in kinds}
                report.add(f"round {round_ + 1}, {label}: CPU per session event (ratio: per rollout event)",
                           f"{per_event['session']:.1f} µs vs {per_event['rollout']:.1f} µs",
                           spent["session"] / spent["rollout"])
            if "before" in cpu:
                for kind in kinds:
                    report.add(f"round {round_ + 1}: CPU per {kind} event, after/before", "",
                               cpu["after"][kind] / cpu["before"][kind])
        report.print()

if __name__ == "__main__":
    main()
