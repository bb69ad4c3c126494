"""Hot reload after the watched paths are deleted and recreated, and a safety poll that runs on
time however busy the watched directories are (proxy.engine.reload)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.engine.policies import PolicyStore
from tests.unit.test_policies import PARSERS, make_configmap, policy_doc
from tests.unit.test_reload import PAST_FIRST_POLL, named, names, until, watching

RECREATED = 2.0  # a recreated target is watched again well before any 10 s safety poll
NO_POLL = 60.0  # a poll interval no test waits for: only file events can make a change seen


@contextlib.asynccontextmanager
async def scribbling(path: Path, every: float = 0.05) -> AsyncIterator[None]:
    """Append to ``path`` every ``every`` seconds around the block (e.g. a log file next to the
    policies), so that the watched directory is never quiet for long."""

    async def scribble() -> None:
        with path.open("a") as fh:
            while True:
                fh.write("x\n")
                fh.flush()
                await asyncio.sleep(every)

    task = asyncio.create_task(scribble())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
@pytest.mark.parametrize("absent", [0.0, 1.5], ids=["at-once", "after-a-while"])
async def test_directory_deleted_and_recreated_is_watched_again(tmp_path: Path,
                                                                absent: float) -> None:
    policy_dir = tmp_path / "pd"
    policy_dir.mkdir()
    (policy_dir / "p.yaml").write_text(policy_doc("one"))
    store = PolicyStore([policy_dir], parsers=PARSERS)
    assert store.reload()
    async with watching(store, armed=PAST_FIRST_POLL, poll_seconds=NO_POLL):
        shutil.rmtree(policy_dir)
        if absent:
            await until(lambda: store.failing, within=1.0)  # "no such file or directory"
            assert names(store) == ["one"]  # the last good set stays
            await asyncio.sleep(absent)  # the watcher re-arms while the directory is missing
        policy_dir.mkdir()
        await asyncio.sleep(0.3)
        (policy_dir / "p.yaml").write_text(policy_doc("two"))
        await until(named(store, "two"), within=RECREATED)
        await asyncio.sleep(0.2)
        (policy_dir / "p.yaml").write_text(policy_doc("three"))  # and any later edit, promptly
        await until(named(store, "three"), within=1.0)
        (policy_dir / "q.yaml").write_text(policy_doc("four"))
        await until(named(store, "three", "four"), within=1.0)
        assert not store.failing


@pytest.mark.asyncio
async def test_file_deleted_with_its_directory_stays_a_file(tmp_path: Path) -> None:
    """A single-file target whose directory goes away and comes back: still only that file."""
    home = tmp_path / "home"
    home.mkdir()
    path = home / "p.yaml"
    path.write_text(policy_doc("one"))
    store = PolicyStore([path], parsers=PARSERS)
    assert store.reload()
    async with watching(store, armed=PAST_FIRST_POLL, poll_seconds=NO_POLL):
        shutil.rmtree(home)
        await until(lambda: store.failing, within=1.0)
        await asyncio.sleep(1.5)
        home.mkdir()
        await asyncio.sleep(0.3)
        path.write_text(policy_doc("two"))
        await until(named(store, "two"), within=RECREATED)
        (home / "other.yaml").write_text(policy_doc("other"))  # not the configured file
        path.write_text(policy_doc("three"))
        await until(named(store, "three"), within=1.0)
        await asyncio.sleep(0.3)
        assert names(store) == ["three"] and store.current.files == (str(path),)


@pytest.mark.asyncio
@pytest.mark.parametrize("target", ["directory", "file"])
async def test_configmap_swap_after_the_mount_is_recreated(tmp_path: Path, target: str) -> None:
    mount = tmp_path / "policies"
    make_configmap(mount, {"policy.yaml": policy_doc("one")}, "2026_11_30_01_00_00.1")
    store = PolicyStore([mount if target == "directory" else mount / "policy.yaml"],
                        parsers=PARSERS)
    assert store.reload()
    async with watching(store, armed=PAST_FIRST_POLL, poll_seconds=NO_POLL):
        shutil.rmtree(mount)
        await until(lambda: store.failing, within=1.0)
        await asyncio.sleep(1.5)
        make_configmap(mount, {"policy.yaml": policy_doc("two")}, "2026_11_30_01_01_00.2")
        await until(named(store, "two"), within=RECREATED)
        await asyncio.sleep(0.2)
        make_configmap(mount, {"policy.yaml": policy_doc("three")}, "2026_11_30_01_02_00.3")
        await until(named(store, "three"), within=1.0)  # a ConfigMap update: within 1 s
        make_configmap(mount, {"policy.yaml": policy_doc("four")}, "2026_11_30_01_03_00.4")
        await until(named(store, "four"), within=1.0)
        assert store.current.files == (str(mount / "policy.yaml"),)


@pytest.mark.asyncio
@pytest.mark.parametrize("target", ["directory", "file"])
async def test_unrelated_writes_do_not_delay_the_safety_poll(tmp_path: Path, target: str) -> None:
    """Steady writes to a log file where the watcher looks must not starve the safety poll.

    The policy file is a symlink to a file elsewhere, so an edit of it makes no event where
    the watcher looks: only the poll (every 0.5 s here) can see it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = elsewhere / "real.yaml"
    real.write_text(policy_doc("one"))
    watched = tmp_path / "watched"
    watched.mkdir()
    (watched / "p.yaml").symlink_to(real)
    store = PolicyStore([watched if target == "directory" else watched / "p.yaml"],
                        parsers=PARSERS)
    assert store.reload()
    async with scribbling(watched / "opgate.log"), watching(store, poll_seconds=0.5):
        await asyncio.sleep(1.5)
        real.write_text(policy_doc("two"))
        await until(named(store, "two"), within=2.0)
        real.write_text(policy_doc("three"))
        await until(named(store, "three"), within=2.0)


@pytest.mark.asyncio
async def test_unrelated_writes_beside_a_recreated_directory(tmp_path: Path) -> None:
    """The QA case: a log file written steadily next to a policy directory that was deleted
    and recreated; a ConfigMap update must still be in effect within a second or two."""
    mount = tmp_path / "policies"
    make_configmap(mount, {"policy.yaml": policy_doc("one")}, "2026_11_30_01_00_00.1")
    store = PolicyStore([mount], parsers=PARSERS)
    assert store.reload()
    async with scribbling(tmp_path / "opgate.log"), \
            watching(store, armed=PAST_FIRST_POLL, poll_seconds=NO_POLL):
        shutil.rmtree(mount)
        await until(lambda: store.failing, within=1.0)
        await asyncio.sleep(1.5)
        make_configmap(mount, {"policy.yaml": policy_doc("two")}, "2026_11_30_01_01_00.2")
        await until(named(store, "two"), within=RECREATED)
        make_configmap(mount, {"policy.yaml": policy_doc("three")}, "2026_11_30_01_02_00.3")
        await until(named(store, "three"), within=1.0)


def _git_sync(root: Path, worktree: str, name: str) -> None:
    """Do what git-sync (``--link current``) does: check out into a worktree of its own, then
    swap the ``current`` symlink to it by renaming a new link over it (the old one stays)."""
    policies = root / ".worktrees" / worktree / "policies"
    policies.mkdir(parents=True)
    (policies / "p.yaml").write_text(policy_doc(name))
    (root / "current.tmp").symlink_to(f".worktrees/{worktree}")
    (root / "current.tmp").replace(root / "current")


@pytest.mark.asyncio
@pytest.mark.parametrize("target", ["directory", "file"])
async def test_a_symlink_swapped_above_the_policies_is_seen_within_a_second(
        tmp_path: Path, target: str) -> None:
    """--policies under a symlink that is swapped to another tree (git-sync's --link, a
    ``current -> release-N`` deploy): the rename happens in a directory above every watched
    one, so it was only noticed at the watch's next 1 s tick, and the poll ran one tick
    later: 1-2 s, and the same again for each later swap."""
    root = tmp_path / "git"
    _git_sync(root, "aaa", "one")
    policies = root / "current" / "policies"
    store = PolicyStore([policies if target == "directory" else policies / "p.yaml"],
                        parsers=PARSERS)
    assert store.reload()
    async with watching(store, armed=PAST_FIRST_POLL, poll_seconds=NO_POLL):
        for worktree, name in (("bbb", "two"), ("ccc", "three"), ("ddd", "four")):
            _git_sync(root, worktree, name)
            await until(named(store, name), within=1.0)
            await asyncio.sleep(0.2)
        (policies / "p.yaml").write_text(policy_doc("five"))  # an edit in the tree in use
        await until(named(store, "five"), within=1.0)
        shutil.rmtree(root / ".worktrees" / "aaa")  # git-sync removing an old tree: no reload
        await asyncio.sleep(0.3)
        assert names(store) == ["five"] and not store.failing
