"""Checks of a finished run's record that several tests rely on (each one is shown to fail on broken input in
tests/test_scheduler.py::test_the_samples_file_check_rejects_broken_records)."""

from dora_jax.dora.ledger import Ledger


def check_trained_samples(rows: list[dict], ledger: Ledger, bound: int) -> None:
    """``rows`` (``samples.jsonl``) against the run's saved ledger: every consumed sample appears once and no
    other sample does; each row's version and trained-at version are the ledger's; staleness is within
    ``[0, bound]``; each group is trained whole, in one update, all on one version.

    Raises:
      AssertionError: naming the first sample or group that breaks one of these.
    """
    ids = [r["sample_id"] for r in rows]
    twice = sorted({s for s in ids if ids.count(s) > 1})
    assert not twice, f"samples trained more than once: {twice}"
    consumed = {s for s, e in ledger.entries.items() if e.state == "consumed"}
    assert set(ids) == consumed, (f"trained but not consumed in the ledger: {sorted(set(ids) - consumed)}; "
                                  f"consumed but never trained: {sorted(consumed - set(ids))}")
    groups: dict[int, set[tuple[int, int]]] = {}
    for r in rows:
        e = ledger.entries[r["sample_id"]]
        assert (r["version"], r["trained_at"], r["group_id"]) == (e.version, e.trained_at, e.group_id), \
            f"sample {r['sample_id']}: version, trained_at, group {(r['version'], r['trained_at'], r['group_id'])}, " \
            f"the ledger has {(e.version, e.trained_at, e.group_id)}"
        lag = r["trained_at"] - r["version"]
        assert 0 <= lag <= bound, f"sample {r['sample_id']} (version {r['version']}) trained at " \
                                  f"{r['trained_at']}: staleness {lag} outside [0, {bound}]"
        groups.setdefault(r["group_id"], set()).add((r["version"], r["trained_at"]))
    for gid, seen in groups.items():
        members = set(ledger.groups[gid].sample_ids)
        assert members <= set(ids), f"group {gid} trained in part: {sorted(members - set(ids))} missing"
        assert len(seen) == 1, f"group {gid} trained on several (version, update) pairs: {sorted(seen)}"
