"""Locust users for `make bench-serve` (loadtest/serving/bench.py writes the plan):

    SERVE_PLAN=plan.json locust -f loadtest/serving/users.py --headless -u U -r U

Each user plays its conversations of the trace (lib.assign) turn by turn: turn
k's prompt is turn k-1's prompt and the answer the engine streamed, then the turn's new user
tokens. Streamed /v1/completions, greedy, the answer's length exactly; TTFT at the first
streamed token. Routing: `rr` (each of a user's requests to the next engine, users staggered)
or `sticky` (a conversation keeps its engine). Each user plays exactly `per_user` requests,
then the run quits: every arm serves the same requests on the same engines, whatever its
speed, so the arms' percentiles compare like with like and pair request by request. Every
request is one JSON line in the plan's `out`, `n` its number within its user (warm-up
included: the report drops each user's first).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import gevent
from locust import User, events, task
from locust.exception import StopUser

from loadtest.serving import lib as sl
from loadtest.serving import trace_replay as bt
from loadtest.serving.fleet import stream_completion

PLAN = (
    json.loads(Path(os.environ["SERVE_PLAN"]).read_text()) if os.environ.get("SERVE_PLAN") else None
)
_seq = itertools.count()
_users = itertools.count()
_done: list[dict] = []


def _conversations(u: int) -> list[sl.Conversation]:
    raw = PLAN["users"][u % len(PLAN["users"])]
    return [sl.Conversation(c["cid"], tuple(sl.Turn(*t) for t in c["turns"])) for c in raw]


def _record(user, got: dict, **fields) -> dict:
    """One request's JSON line (appended to the plan's `out`) and its Locust event."""
    rec = {
        "seq": next(_seq),
        "user": user.uid,
        "n": user.n,
        **fields,
        "start": got["start"],
        "end": got["end"],
        "ttft": got["ttft"],
        "e2e": got["e2e"],
        "out_tokens": len(got["tokens"]),
        "cached_tokens": got["cached_tokens"],
        "status": got["status"],
        **({"error": got["error"]} if "error" in got else {}),
    }
    failure = Exception(got["error"]) if "error" in got else None
    events.request.fire(
        request_type="completion",
        name=PLAN["policy"],
        response_time=got["e2e"] * 1e3,
        response_length=len(got["tokens"]),
        exception=failure,
        context={},
    )
    with open(PLAN["out"], "a") as f:
        f.write(json.dumps(rec) + "\n")
    _done.append(rec)
    return rec


def _quit_when_done(user, total: int) -> None:
    if len(_done) == total and user.environment.runner is not None:
        # from a greenlet of its own: quit() stops every user, this one too, midway
        gevent.spawn(user.environment.runner.quit)


_next_request = itertools.count()
_t0: list[float] = []


class TraceUser(User):
    """One of the users sending the trace's requests (trace.py), each the next in
    the trace's order, at its timestamp x `time_scale` after the run began (0: at once)."""

    def on_start(self) -> None:
        self.uid = next(_users)
        self.n = 0
        if not _t0:
            _t0.append(time.time())

    @task
    def request(self) -> None:
        reqs = PLAN["requests"]
        i = next(_next_request)
        if i >= len(reqs):
            raise StopUser()
        idx, cid, hash_ids, tokens, max_tokens, at = reqs[i]
        due = _t0[0] + at * PLAN["time_scale"] - time.time()
        if due > 0:
            gevent.sleep(due)
        req = bt.TraceRequest(idx, cid, tuple(hash_ids), tokens, max_tokens, at)
        engine = PLAN["engines"][sl.route(PLAN["policy"], i, cid, len(PLAN["engines"]))]
        got = stream_completion(
            "127.0.0.1", engine, PLAN["model"], req.prompt(PLAN["block"]), max_tokens
        )
        _record(self, got, cid=idx, turn=0, engine=engine, prompt_tokens=tokens)
        self.n += 1
        _quit_when_done(self, len(reqs))


class ConversationUser(User):
    """One user: its conversations in order, each from its first turn."""

    def on_start(self) -> None:
        self.uid = next(_users)
        self.convs = _conversations(self.uid)
        self.ci, self.k, self.n, self.prompt, self.answer = 0, 0, 0, [], []

    @task
    def turn(self) -> None:
        if self.n >= PLAN["per_user"]:
            raise StopUser()
        conv = self.convs[self.ci % len(self.convs)]
        prompt = sl.next_prompt(self.prompt, self.answer, conv, self.k)
        which = sl.route(PLAN["policy"], self.uid + self.n, conv.cid, len(PLAN["engines"]))
        engine = PLAN["engines"][which]
        got = stream_completion(
            "127.0.0.1", engine, PLAN["model"], prompt, conv.turns[self.k].max_tokens
        )
        _record(self, got, cid=conv.cid, turn=self.k, engine=engine, prompt_tokens=len(prompt))
        self.prompt, self.answer = prompt, got["tokens"]
        self.k, self.n = self.k + 1, self.n + 1
        if self.k == len(conv.turns) or "error" in got:
            self.ci, self.k, self.prompt, self.answer = self.ci + 1, 0, [], []
        _quit_when_done(self, PLAN["per_user"] * len(PLAN["users"]))
