import json

from typer.testing import CliRunner

from agentstream.cli import app
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
