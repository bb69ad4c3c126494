"""``freeze_startup_objects``: what start-up built is left out of later garbage collections.

A full collection walks every object the collector tracks; in a serving opgate that is the
~50k objects of its imports and set-up, a pause of tens of milliseconds for every call that
waits on it. After the freeze the collector tracks only what was made since.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json
import proxy.app  # the serving stack: every middleware, the relay, the admin port
before = len(gc.get_objects())
frozen = proxy.app.freeze_startup_objects()
print(json.dumps({"before": before, "frozen": frozen, "after": len(gc.get_objects())}))
"""


def test_startup_objects_are_frozen_out_of_collections() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, timeout=60)
    counts = json.loads(out.stdout)
    assert counts["before"] > 10_000  # what a full collection walked before
    assert counts["frozen"] >= counts["before"] * 0.9
    assert counts["after"] < 1_000  # what it walks now
