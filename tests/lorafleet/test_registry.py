"""Registry management against real Redis: immutability, channels, retirement."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from contracts.errors import ErrorCode
from contracts.queues import Tier
from lorafleet.publish import Publisher
from lorafleet.registry import RegistryError


def test_alias_is_immutable_and_republishing_same_bytes_is_a_noop(
    publisher: Publisher, fixtures_dir: Path, tmp_path: Path
) -> None:
    source = fixtures_dir / "adapters" / "lora-02-r4-qv"
    first = publisher.publish(source, "reg-immutable", Tier.COLD)
    again = publisher.publish(source, "reg-immutable", Tier.COLD)
    assert again == first
    other = fixtures_dir / "adapters" / "lora-06-r4-qv"
    with pytest.raises(RegistryError) as caught:
        publisher.publish(other, "reg-immutable", Tier.COLD)
    assert caught.value.code == ErrorCode.ALIAS_EXISTS
    assert publisher.registry.require("reg-immutable") == first
    # The same bytes under a second alias is fine: one artifact, two names.
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert publisher.publish(copy, "reg-immutable-2", Tier.COLD).digest == first.digest


def test_channels_point_at_existing_active_aliases_only(
    publisher: Publisher, fixtures_dir: Path
) -> None:
    registry = publisher.registry
    a = publisher.publish(fixtures_dir / "adapters" / "lora-02-r4-qv", "reg-chan-a", Tier.COLD)
    b = publisher.publish(fixtures_dir / "adapters" / "lora-06-r4-qv", "reg-chan-b", Tier.COLD)
    assert registry.set_channel("reg-chan", a.alias) is None
    assert registry.set_channel("reg-chan", b.alias) == a.alias
    assert registry.channel("reg-chan") == b.alias
    assert registry.channels()["reg-chan"] == b.alias

    with pytest.raises(RegistryError) as missing:
        registry.set_channel("reg-chan", "reg-no-such")
    assert missing.value.code == ErrorCode.ADAPTER_NOT_FOUND
    with pytest.raises(RegistryError) as clash:
        registry.set_channel(a.alias, b.alias)
    assert clash.value.code == ErrorCode.NAME_TAKEN
    with pytest.raises(RegistryError) as taken:
        publisher.publish(fixtures_dir / "adapters" / "lora-10-r4-qv", "reg-chan", Tier.COLD)
    assert taken.value.code == ErrorCode.NAME_TAKEN
    with pytest.raises(RegistryError) as bad:
        registry.set_channel("Bad/Name", a.alias)
    assert bad.value.code == ErrorCode.NAME_INVALID
    assert registry.channel("reg-chan") == b.alias


def test_retired_alias_cannot_become_a_channel_target(
    publisher: Publisher, fixtures_dir: Path
) -> None:
    registry = publisher.registry
    record = publisher.publish(fixtures_dir / "adapters" / "lora-10-r4-qv", "reg-retire", Tier.COLD)
    registry.retire(record.alias)
    assert record.alias in registry.retired()
    with pytest.raises(RegistryError) as caught:
        registry.set_channel("reg-retire-chan", record.alias)
    assert caught.value.code == ErrorCode.ADAPTER_RETIRED
    with pytest.raises(RegistryError) as unknown:
        registry.retire("reg-never-published")
    assert unknown.value.code == ErrorCode.ADAPTER_NOT_FOUND
