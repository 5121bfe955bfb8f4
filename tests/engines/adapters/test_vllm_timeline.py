"""The connector's timeline (api/engine/vllm_timeline.py, issue 53): rows reach the file in
order, the file is the engine's own (0600) and a link planted at its path is refused (the
timeline turns off), and nothing raises into the engine."""

from __future__ import annotations

import json
import os
import stat

from api.engine.vllm_timeline import FLUSH_ROWS, Timeline


def test_rows_reach_the_file_private_and_in_order(tmp_path):
    path = tmp_path / "timeline.jsonl"
    t = Timeline(str(path))
    for i in range(FLUSH_ROWS + 3):
        t.add("save", save_s=0.001 * i, save_pages=i, skipped=0)
    t.flush()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["save_pages"] for r in rows] == list(range(FLUSH_ROWS + 3))
    assert all(r["kind"] == "save" and r["t"] > 0 for r in rows)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_link_at_its_path_is_refused_and_the_timeline_turns_off(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    link = tmp_path / "timeline.jsonl"
    link.symlink_to(victim)
    t = Timeline(str(link))
    t.add("set", set_s=0.1, pages=1)
    t.flush()  # no exception into the engine
    assert victim.read_text() == "keep\n" and not t.on
    t.add("set", set_s=0.1, pages=1)  # off: nothing kept, nothing written
    t.flush()
    assert victim.read_text() == "keep\n"
