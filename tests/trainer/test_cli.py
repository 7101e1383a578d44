"""`agentstream train` forwards its arguments to the trainer's own command line."""

from __future__ import annotations

from typer.testing import CliRunner

from agentstream.cli import app

runner = CliRunner()


def test_train_help_is_the_trainers():
    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--base-model", "--group-size", "--adv-estimator", "--offline-topic", "--max-staleness"):
        assert flag in result.output


def test_bad_settings_are_named():
    result = runner.invoke(app, ["train", "--adv-estimator", "gae", "--lr", "0"])
    assert result.exit_code == 2  # a bad setting, as every entrypoint says it (schemas.flags)
    message = str(result.exception) + result.output
    assert "--adv-estimator" in message and "choose one of grpo" in message and "--lr" in message


def test_no_model_to_start_from_says_what_to_do(tmp_path, kafka):
    result = runner.invoke(app, ["train", "--bootstrap-servers", kafka.bootstrap_servers,
                                 "--topic-prefix", kafka.topic_prefix, "--checkpoint-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "no checkpoint in" in str(result.exception) and "--base-model DIR" in str(result.exception)
