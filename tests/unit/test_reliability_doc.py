"""docs/reliability.md lists each promise with the tests that hold it: every file and test it names exists, so a
renamed or removed test cannot leave a promise held by nothing."""

from __future__ import annotations

import os
import re

from helpers import REPO


def test_every_test_the_promises_name_exists():
    doc = open(os.path.join(REPO, "docs", "reliability.md")).read()
    table = doc.split("## Promises and the tests that hold them", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| promise")]
    assert len(rows) >= 8
    for row in rows:
        held_by = row.rstrip(" |").rsplit(" | ", 1)[1]
        files = re.findall(r"`(tests/[\w/]+\.py)", held_by)
        assert files, row
        sources = "".join(open(os.path.join(REPO, f)).read() for f in files)
        for name in re.findall(r"\b(test_\w+?)(?:\[|`)", held_by):
            if not name.endswith("_") and f"/{name}.py" not in held_by:
                assert re.search(rf"def {name}\(", sources), f"{name} (named in docs/reliability.md) is in none of {files}"
