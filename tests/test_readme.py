"""The README stays true: its configuration table names every setting and Procfile variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from gateway.config import GatewaySettings
from lorafleet.settings import LocalSettings
from lorafleet.stack import procfile_commands
from worker.config import WorkerSettings
from worker.webhooks.config import WebhookSettings

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _documented() -> set[str]:
    return set(re.findall(r"^\| `([A-Z0-9_]+)` \|", README, flags=re.MULTILINE))


@pytest.mark.parametrize(
    "settings", [GatewaySettings, WorkerSettings, WebhookSettings, LocalSettings]
)
def test_every_setting_is_in_the_configuration_table(settings: type[BaseSettings]) -> None:
    prefix = settings.model_config.get("env_prefix", "")
    names = {
        str(field.validation_alias or prefix + name.upper())
        for name, field in settings.model_fields.items()
    }
    assert names - _documented() == set()


def test_every_procfile_variable_is_documented() -> None:
    variables = set()
    for command in procfile_commands().values():
        variables |= set(re.findall(r"\$\{([A-Z0-9_]+)", command))
    assert variables
    assert variables - _documented() == set()


def test_readme_starts_with_the_two_commands() -> None:
    first_block = README.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
    assert "make test" in (REPO / ".ci" / "run").read_text()
