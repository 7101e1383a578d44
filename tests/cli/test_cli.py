import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from agentstream.cli import app
from agentstream.cli.options import renamed
from agentstream.schemas import EVENT_TYPES

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("kafka", "vllm", "model", "schemas", "topics"):
        assert command in result.output


def test_schemas_export_writes_one_schema_per_event_type(tmp_path):
    result = runner.invoke(app, ["schemas", "export", str(tmp_path)])
    assert result.exit_code == 0, result.output
    files = sorted(tmp_path.glob("*.schema.json"))
    assert len(files) == len(EVENT_TYPES)
    call = json.loads((tmp_path / "call.schema.json").read_text())
    assert "prompt_token_ids" in call["$defs"]["Call"]["properties"]


def test_topics_ensure_reports_mismatch_with_exit_code(kafka, monkeypatch):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    ok = runner.invoke(app, ["topics", "ensure", "--prefix", kafka.topic_prefix])
    assert ok.exit_code == 0, ok.output
    assert "exists" in ok.output
    wrong = runner.invoke(app, ["topics", "ensure", "--prefix", kafka.topic_prefix, "--partitions", "2"])
    assert wrong.exit_code == 2
    assert "partitions, expected 2" in wrong.output


def test_an_agentstream_error_is_one_line_naming_the_fix_not_a_traceback(tmp_path):
    """Any command's AgentstreamError (here: an archive that holds nothing) reaches the operator as one line."""
    result = runner.invoke(app, ["replay", "export", str(tmp_path / "out.jsonl"), "--source", "archive",
                                 "--archive", str(tmp_path / "empty")],
                           env={"COLUMNS": "400", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})  # (no broker needed)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    said = result.output.strip()
    assert said.startswith("error: the archive") and said.endswith("(or use --source kafka)")
    assert len(said.splitlines()) == 1 and "Traceback" not in result.output


def test_topic_prefix_is_the_flag_and_the_old_prefix_a_hidden_alias(tmp_path):
    """`--topic-prefix` (the services' name) is in the help; `--prefix` still works for one release, unlisted."""
    shown = runner.invoke(app, ["replay", "export", "--help"], env={"COLUMNS": "200"})
    assert "--topic-prefix" in shown.output and "--prefix " not in shown.output
    env = {"COLUMNS": "400", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}  # (the archive is read: no broker needed)
    for args in (["--topic-prefix", "new."], ["--prefix", "old."], ["--prefix=old."]):
        result = runner.invoke(app, ["replay", "export", str(tmp_path / "out.jsonl"), "--source", "archive",
                                     "--archive", str(tmp_path / "empty"), *args], env=env)
        prefix = args[-1].split("=")[-1]
        assert result.exit_code == 1 and f"'{prefix}rollouts'" in result.output, (args, result.output)


def test_old_flag_names_are_renamed_only_before_a_double_dash_and_where_the_command_has_the_new():
    own = {"--topic-prefix", "--since"}
    assert renamed(["--prefix", "p", "--since", "1h", "--", "--prefix", "q"], own) == [
        "--topic-prefix", "p", "--since", "1h", "--", "--prefix", "q"]
    assert renamed(["--prefix=p"], own) == ["--topic-prefix=p"]
    assert renamed(["--prefix", "p"], {"--since"}) == ["--prefix", "p"]


def test_replay_train_leaves_what_follows_a_double_dash_to_the_trainer(tmp_path):
    """The trainer's own flags go after `--`; one naming what replay train sets itself is refused, by name."""
    result = runner.invoke(app, ["replay", "train", "--prefix", "p.", "--", "--topic-prefix", "q."],
                           env={"COLUMNS": "400", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.exit_code == 1
    assert "replay train sets --topic-prefix itself" in result.output and "with --topic-prefix" in result.output


def test_python_m_agentstream_cli_is_the_same_command():
    for module in ("agentstream", "agentstream.cli"):
        result = subprocess.run([sys.executable, "-m", module, "sql", "--help"], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert result.returncode == 0 and "--topic-prefix" in result.stdout, result.stderr
