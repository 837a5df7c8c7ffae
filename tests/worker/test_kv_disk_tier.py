"""One rank's disk tier: files round-trip after a restart; a truncated, corrupted or foreign file is skipped
and removed; an unwritable directory fails to open and a failed write turns the tier off; the storage's
block bytes round-trip through a payload."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tideserve.worker.kv_disk_tier import HEADER_BYTES, DiskTier
from tideserve.worker.kv_store import KVCacheStorage, KVLayout

FP = {"model": "m", "dtype": "float32"}
PAYLOAD = 64


def _payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAYLOAD))


def _tier(root: Path, fingerprint: dict[str, str] = FP) -> DiskTier:
    tier = DiskTier(root, fingerprint)
    tier.open()
    return tier


def test_blocks_round_trip_through_files_and_a_restart(tmp_path):
    tier = _tier(tmp_path)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        tier.save(key, _payload(i))
    assert [bytes(p) for p in tier.load(keys, PAYLOAD).payloads] == [_payload(i) for i in range(3)]  # pending
    tier.close()
    again = _tier(tmp_path)
    assert {f.key for f in again.scan()} == set(keys)
    assert all(f.num_bytes == HEADER_BYTES + PAYLOAD for f in again.scan())
    result = again.load(keys, PAYLOAD)
    assert [bytes(p) for p in result.payloads] == [_payload(i) for i in range(3)]
    assert result.bytes_read == 3 * (HEADER_BYTES + PAYLOAD) and result.bad_keys == []
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "other_fingerprint"])
def test_a_bad_file_is_skipped_and_removed(tmp_path, damage):
    tier = _tier(tmp_path)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        tier.save(key, _payload(i))
    tier.close()
    bad = tier.path_of(keys[1])
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[HEADER_BYTES + 5] ^= 0xFF
        bad.write_bytes(bytes(data))
    elif damage == "truncate":
        bad.write_bytes(bytes(data[:-7]))
    elif damage == "foreign":  # another block's file under this name
        shutil.copy(tier.path_of(keys[2]), bad)
    else:  # a file written under another fingerprint
        other = _tier(tmp_path / "other", {**FP, "dtype": "bfloat16"})
        other.save(keys[1], _payload(1))
        other.close()
        shutil.copy(other.path_of(keys[1]), bad)
    again = _tier(tmp_path)
    result = again.load(keys, PAYLOAD)
    assert [bytes(p) for p in result.payloads] == [_payload(0)]  # stops at the bad one
    assert result.bad_keys == [keys[1]] and not bad.exists()
    assert again.path_of(keys[2]).exists()


def test_a_missing_file_is_a_miss_not_a_bad_file(tmp_path):
    tier = _tier(tmp_path)
    result = tier.load([b"x" * 16], PAYLOAD)
    assert result.payloads == [] and result.bad_keys == []


def test_an_unwritable_directory_fails_to_open_and_a_failed_write_turns_the_tier_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        DiskTier(blocker / "kv", FP).open()
    tier = _tier(tmp_path / "kv")
    shutil.rmtree(tier.dir)
    tier.dir.write_text("the disk went away")  # every write below it now fails
    tier.save(b"k" * 16, _payload(0))
    tier.flush()
    assert tier.error is not None
    tier.save(b"j" * 16, _payload(1))  # ignored once off
    tier.close()


def test_stale_temporary_files_are_removed_by_a_scan(tmp_path):
    tier = _tier(tmp_path)
    sub = tier.dir / "ab"
    sub.mkdir()
    stale = sub / ".abcd.kv.1.2.3.tmp"
    stale.write_bytes(b"partial")
    os.utime(stale, (0, 0))
    tier.scan()
    assert not stale.exists()
    tier.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_block_bytes_round_trip_through_the_storage(dtype):
    storage = KVCacheStorage(KVLayout(2, 2, 4, dtype), torch.device("cpu"), 4)
    storage.create_store(6, 6 * storage.bytes_per_block(), static=True)
    for k, v in storage.caches:
        for t in (k, v):
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, dtype=torch.uint8))
    rows = storage.read_blocks([1, 4])
    assert rows.shape == (2, storage.bytes_per_block())
    storage.write_blocks([2, 5], [rows[0].tobytes(), rows[1]])
    for k, v in storage.caches:
        for t in (k, v):
            raw = t.view(torch.uint8)
            assert torch.equal(raw[2], raw[1]) and torch.equal(raw[5], raw[4])
