"""Hot reload (proxy.engine.reload): file events, the ConfigMap ..data swap, broken edits, load."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from proxy.engine.policies import PolicySet, PolicyStore
from proxy.engine.reload import watch_policies
from tests.unit.test_policies import PARSERS, make_configmap, policy_doc, reloads

ARMED = 0.3  # time for the watcher thread to set up inotify before a test changes files
PAST_FIRST_POLL = 1.3  # the first safety poll runs at the first 1 s tick of the watch


def names(store: PolicyStore) -> list[str]:
    return [p.name for p in store.current.policies]


def named(store: PolicyStore, *expected: str) -> Callable[[], bool]:
    """A condition for :func:`until`: the active set is exactly these policies."""
    return lambda: names(store) == list(expected)


async def until(condition: Callable[[], bool], *, within: float) -> float:
    """Seconds until ``condition()`` holds; fails the test after ``within`` seconds."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > within:
            pytest.fail(f"condition not met within {within}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def watching(store: PolicyStore, *, armed: float = ARMED,
                   poll_seconds: float = 10.0) -> AsyncIterator[asyncio.Task[None]]:
    """Run watch_policies around the block. ``armed=PAST_FIRST_POLL`` starts the block after the
    watcher's first safety poll, so that only a file event can make a change seen within 1 s."""
    task = asyncio.create_task(watch_policies(store, poll_seconds=poll_seconds))
    await asyncio.sleep(armed)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_edit_in_a_directory_is_seen_within_a_second(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(policy_doc("one"))
    store = PolicyStore([tmp_path], parsers=PARSERS)
    assert store.reload()
    async with watching(store):
        (tmp_path / "p.yaml").write_text(policy_doc("two"))
        await until(named(store, "two"), within=1.0)
        (tmp_path / "q.yml").write_text(policy_doc("three"))  # a new file in the directory
        await until(named(store, "two", "three"), within=1.0)
        (tmp_path / "q.yml").unlink()
        await until(named(store, "two"), within=1.0)


@pytest.mark.asyncio
async def test_single_file_is_watched_through_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("one"))
    store = PolicyStore([path], parsers=PARSERS)
    assert store.reload()
    async with watching(store, armed=PAST_FIRST_POLL, poll_seconds=60):
        attempts = sum(reloads(r) for r in ("success", "error", "unchanged"))
        (tmp_path / "other.yaml").write_text("not: [valid\n")  # not ours: ignored
        await asyncio.sleep(0.3)
        assert sum(reloads(r) for r in ("success", "error", "unchanged")) == attempts
        tmp = tmp_path / ".p.yaml.swp"
        tmp.write_text(policy_doc("two"))
        os.replace(tmp, path)  # how many editors save
        await until(named(store, "two"), within=1.0)


@pytest.mark.asyncio
async def test_configmap_data_swap_is_seen_within_a_second(tmp_path: Path) -> None:
    mount = tmp_path / "policies"
    make_configmap(mount, {"policy.yaml": policy_doc("one")}, "2026_11_30_01_00_00.123")
    for minute, paths in enumerate(([mount], [mount / "policy.yaml"])):
        store = PolicyStore(paths, parsers=PARSERS)
        assert store.reload() and names(store) == ["one"]
        async with watching(store, armed=PAST_FIRST_POLL, poll_seconds=60):
            make_configmap(mount, {"policy.yaml": policy_doc("two")},
                           f"2026_11_30_01_{minute:02}_10.456")
            await until(named(store, "two"), within=1.0)
            assert store.current.files == (str(mount / "policy.yaml"),)
        make_configmap(mount, {"policy.yaml": policy_doc("one")}, f"2026_11_30_01_{minute:02}_20.7")


@pytest.mark.asyncio
async def test_broken_edit_keeps_the_good_set(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("good"))
    store = PolicyStore([tmp_path], parsers=PARSERS)
    assert store.reload()
    good = store.current
    errors = reloads("error")
    async with watching(store):
        path.write_text(policy_doc("good", "  mode: loud\n"))
        await until(lambda: store.failing, within=1.0)
        assert store.current is good
        assert store.last_error == (f'{path}:6: spec.mode: must be one of enforce, dryrun '
                                    '(got "loud")')
        assert reloads("error") == errors + 1
        assert store.describe()["last_error"] == store.last_error
        path.write_text(policy_doc("fixed"))
        await until(named(store, "fixed"), within=1.0)
        assert not store.failing


@pytest.mark.asyncio
async def test_safety_poll_catches_what_inotify_cannot_see(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "real.yaml"
    target.write_text(policy_doc("one"))
    watched = tmp_path / "watched"
    watched.mkdir()
    (watched / "p.yaml").symlink_to(target)  # edits to the target make no event in `watched`
    store = PolicyStore([watched / "p.yaml"], parsers=PARSERS)
    assert store.reload()
    async with watching(store, poll_seconds=0.2):
        target.write_text(policy_doc("two"))
        await until(named(store, "two"), within=5.0)


@pytest.mark.asyncio
async def test_change_before_the_watch_starts_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("one"))
    store = PolicyStore([path], parsers=PARSERS)
    assert store.reload()
    path.write_text(policy_doc("two"))  # after the first load, before the watcher runs
    async with watching(store):
        await until(named(store, "two"), within=3.0)


@pytest.mark.asyncio
async def test_missing_directory_then_created(tmp_path: Path) -> None:
    later = tmp_path / "later"
    store = PolicyStore([later], parsers=PARSERS)
    assert not store.reload()
    async with watching(store, poll_seconds=0.2):
        later.mkdir()
        (later / "p.yaml").write_text(policy_doc("late"))
        await until(named(store, "late"), within=5.0)


@pytest.mark.asyncio
async def test_cancel_is_prompt_and_clean(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(policy_doc("one"))
    store = PolicyStore([tmp_path], parsers=PARSERS)
    store.reload()
    task = asyncio.create_task(watch_policies(store))
    await asyncio.sleep(ARMED)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 1.0  # the watcher thread stopped, not timed out
    (tmp_path / "p.yaml").write_text(policy_doc("two"))
    await asyncio.sleep(0.3)
    assert names(store) == ["one"]  # nothing watches any more


@pytest.mark.asyncio
async def test_hot_reload_under_load(tmp_path: Path) -> None:
    """Readers never see a broken or half-built set while the file is rewritten 20 times."""
    path = tmp_path / "p.yaml"
    path.write_text(policy_doc("v0"))
    store = PolicyStore([path], parsers=PARSERS)
    assert store.reload()
    valid: dict[str, PolicySet] = {"v0": store.current}
    observed: list[PolicySet] = []
    stop = asyncio.Event()

    async def reader() -> None:
        while not stop.is_set():
            current = store.current  # what a request takes at its start
            if not observed or observed[-1] is not current:
                observed.append(current)
            await asyncio.sleep(0)

    broken = {3, 7, 11, 15, 18}
    errors = reloads("error")
    async with watching(store):
        reading = asyncio.create_task(reader())
        for i in range(1, 21):
            if i in broken:
                path.write_text(policy_doc(f"v{i}", f"  mode: broken{i}\n"))
                marker = f"broken{i}"
                await until(lambda: marker in store.last_error, within=2.0)  # noqa: B023
            else:
                spec = "  faults: []\n" if i % 2 else "  mode: dryrun\n"
                path.write_text(policy_doc(f"v{i}", spec))
                await until(named(store, f"v{i}"), within=2.0)
                valid[f"v{i}"] = store.current
        stop.set()
        await reading

    assert reloads("error") == errors + len(broken)
    assert len(observed) >= 2
    assert all(any(s is v for v in valid.values()) for s in observed)
    assert not {p.name for s in observed for p in s.policies} & {f"v{i}" for i in broken}
    assert store.last_error == (f'{path}:6: spec.mode: must be one of enforce, dryrun '
                                '(got "broken18")')
    assert names(store) == ["v20"]


@pytest.mark.asyncio
@pytest.mark.parametrize("emptied", ["", "# cut short\n---\n"])
async def test_emptied_file_keeps_the_good_set(tmp_path: Path, emptied: str) -> None:
    """A file truncated to nothing (or to comments) is an error, not a silent loss of rules."""
    (tmp_path / "a.yaml").write_text(policy_doc("a"))
    path = tmp_path / "b.yaml"
    path.write_text(policy_doc("b"))
    store = PolicyStore([tmp_path], parsers=PARSERS)
    assert store.reload()
    good = store.current
    errors = reloads("error")
    async with watching(store):
        path.write_text(emptied)
        await until(lambda: store.failing, within=1.0)
        assert store.current is good and names(store) == ["a", "b"]
        assert store.last_error == f"{path}:1: no policy document in this file"
        assert reloads("error") == errors + 1
        path.write_text(policy_doc("c"))
        await until(named(store, "a", "c"), within=1.0)
        assert not store.failing
