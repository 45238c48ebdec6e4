"""A fault-tolerant job's secret (ddpkit.fault_tolerance.job_secret): HMAC-SHA256 tags on every value in the job's
store and on what its peers send one another. Expected tags are computed here with the standard library's hmac from
the definition (RFC 2104 over the key and the value), not with the module's helpers."""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddpkit.fault_tolerance import job_secret
from ddpkit.fault_tolerance.job_secret import SignedStore, UnsignedValue, seal, unseal
from ddpkit.fault_tolerance.membership import Membership

SECRET = b"0123456789abcdef0123"
OTHER = b"fedcba9876543210fedc"


def _expected(secret: bytes, key: str, value: bytes) -> bytes:
    context = b"store\0" + key.encode()
    tag = hmac.new(secret, struct.pack(">I", len(context)) + context + value, hashlib.sha256).digest()
    return job_secret.MARK + tag + struct.pack(">I", len(value)) + value


def test_the_secret_comes_from_the_variable_or_a_file_and_a_bad_one_is_named(tmp_path):
    assert job_secret.secret_from_environment({}) is None
    assert job_secret.secret_from_environment({"DDPKIT_JOB_SECRET": "x" * 16}) == b"x" * 16
    path = tmp_path / "secret"
    path.write_bytes(b"y" * 20 + b"\n")
    assert job_secret.secret_from_environment({"DDPKIT_JOB_SECRET_FILE": str(path)}) == b"y" * 20
    with pytest.raises(ValueError, match="set one of DDPKIT_JOB_SECRET and DDPKIT_JOB_SECRET_FILE, not both"):
        job_secret.secret_from_environment({"DDPKIT_JOB_SECRET": "x" * 16, "DDPKIT_JOB_SECRET_FILE": str(path)})
    with pytest.raises(ValueError, match=r"the job's secret in DDPKIT_JOB_SECRET has 5 bytes; give at least 16"):
        job_secret.secret_from_environment({"DDPKIT_JOB_SECRET": "short"})
    with pytest.raises(ValueError, match=r"DDPKIT_JOB_SECRET_FILE=.*missing: cannot read the job's secret"):
        job_secret.secret_from_environment({"DDPKIT_JOB_SECRET_FILE": str(tmp_path / "missing")})


def test_every_value_is_tagged_over_its_key_and_bytes_and_a_forged_moved_or_foreign_value_is_refused():
    raw = dist.HashStore()
    store = SignedStore(raw, SECRET)
    store.set("a", "members")
    assert raw.get("a") == _expected(SECRET, "a", b"members") and store.get("a") == b"members"
    store.multi_set(["b", "c"], ["1", b"\x00\xff"])
    assert store.multi_get(["b", "c"]) == [b"1", b"\x00\xff"]
    store.append("list", "3,")
    store.append("list", "12,")
    assert raw.get("list") == _expected(SECRET, "list", b"3,") + _expected(SECRET, "list", b"12,")
    assert store.get("list") == b"3,12,"
    # compare-and-set: empty means "no such key"; a value compares with the value, not its tag
    assert store.compare_set("v", "", "0") == b"0" and store.compare_set("v", "0", "1") == b"1"
    assert store.compare_set("v", "0", "2") == b"1" and store.get("v") == b"1"
    assert store.add("count", 2) == 2  # counters pass through untagged
    raw.set("forged", "1")
    raw.set("moved", raw.get("a"))  # a genuine value replayed under another key
    SignedStore(raw, OTHER).set("foreign", "1")
    raw.append("list", "7,")  # a rank listed by someone without the secret
    for key, why in (
        ("forged", "has no tag"),
        ("moved", "has a wrong tag"),
        ("foreign", "has a wrong tag"),
        ("list", "has no tag"),
    ):
        with pytest.raises(UnsignedValue, match=f"the value of '{key}' in the job's store {why}: .* DDPKIT_JOB_SECRET"):
            store.get(key)
    with pytest.raises(UnsignedValue):
        store.compare_set("forged", "", "2")  # the value it returns is checked too
    assert isinstance(job_secret.protect(raw, SECRET), SignedStore) and job_secret.protect(store) is store
    assert job_secret.unsigned(store) is raw and job_secret.unsigned(raw) is raw


def test_a_sealed_message_is_refused_when_a_byte_its_context_or_the_secret_differs():
    payload = torch.arange(200, dtype=torch.uint8)
    message = seal(payload, SECRET, "heal of round 4")
    context = b"message\0heal of round 4"
    tag = hmac.new(SECRET, struct.pack(">I", len(context)) + context + bytes(range(200)), hashlib.sha256)
    assert bytes(message[:32].tolist()) == tag.digest() and torch.equal(message[32:], payload)
    assert torch.equal(unseal(message, SECRET, "heal of round 4"), payload)
    changed = message.clone()
    changed[100] ^= 1
    cases = [(changed, SECRET, "heal of round 4"), (message, SECRET, "heal of round 5")]
    cases += [(message, OTHER, "heal of round 4"), (payload, SECRET, "heal of round 4")]
    for bad, secret, context in cases:
        with pytest.raises(UnsignedValue, match=r"a peer's heal of round \d arrived without a valid tag"):
            unseal(bad, secret, context)
    assert seal(payload, None, "x") is payload and unseal(payload, None, "x") is payload


def _round_0(stores: list, world: int) -> list:
    memberships = [Membership(s, r, world, quorum_timeout=5.0, start_timeout=20.0) for r, s in enumerate(stores)]
    quorums: list = [None] * world
    threads = [
        threading.Thread(target=lambda r=r: quorums.__setitem__(r, memberships[r].quorum(0))) for r in range(world)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(q is not None and q.members == list(range(world)) for q in quorums), quorums
    return quorums


def test_with_a_secret_a_forged_report_cannot_commit_a_round_for_a_member_that_did_not_report():
    """The commit's reports are signed keys, one per member; the count of reports (`add`: untagged) only says when
    to read them. Someone without the secret writes rank 1's report and adds to the count: rank 0 reads the forged
    report, refuses it, and no verdict is written; rank 1's own report then commits the round."""
    raw = dist.HashStore()
    raw.set_timeout(timedelta(seconds=20))
    quorums = _round_0([SignedStore(raw, SECRET) for _ in range(2)], 2)
    key = quorums[0]._membership._key(0, "report", 1)
    raw.set(key, "1")
    raw.add(quorums[0]._membership._key(0, "reported"), 1)  # and the count of reports, which is not tagged
    with pytest.raises(UnsignedValue, match=f"the value of '{key}' in the job's store has no tag"):
        quorums[0].commit(True)
    assert not raw.check([quorums[0]._membership._key(0, "verdict")])
    quorums[1]._membership.store.set(key, "1")  # rank 1's genuine report
    assert quorums[0].commit(True) and quorums[1].commit(True)
