"""Red-team runner (issue 26): each attack against a fresh root sidecar, with /healthz timed
on both listeners while it runs.

    python -m loadtest.redteam.runner [--only NAME ...] [--seconds S] [--json]

    this process                                  sidecar (python -m sidecar serve, root)
    +------------------------------+  TCP         +-----------------------------------+
    | prober: GET /healthz every   |------------->| loopback listener                 |
    |   20 ms on a connection made |  engine sock | engine socket (0666 here: any uid)|
    |   before the attack, on each |------------->| <socket>.fds                      |
    |   listener; latency kept     |              +-----------------------------------+
    | attack(target, stop) in a    |                    ^
    |   thread (forks a child as   |--------------------+
    |   uid nobody where it must)  |
    +------------------------------+

An attack module (`loadtest/redteam/*.py`) lists `ATTACKS: list[Attack]`. `run(target,
stop)` attacks until `stop` is set (the runner sets it after `seconds`) or it is done, and
returns facts: at least `held` (True when the sidecar kept its promise). The runner adds
the /healthz latencies seen meanwhile (max and p99, per listener; a probe that fails
counts as `inf`) and the sidecar's RSS (at the start, its maximum, the growth), and prints
one row per attack. A promise is kept only when `held`, the sidecar lived, /healthz stayed
under 50 ms on both listeners and its RSS grew less than the attack's `rss_limit_mib`
(128 MiB unless the attack says; issue 43).
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.kit.procs import SidecarProcess
from loadtest.kit.unix_http import UnixHTTPConnection
from loadtest.redteam.attack import Attack, Target, rss_mib

MODULES = (
    "loadtest.redteam.conn",
    "loadtest.redteam.lend",
    "loadtest.redteam.store",
    "loadtest.redteam.controls",
    "loadtest.redteam.pipe",
    "loadtest.redteam.events",
    "loadtest.redteam.tenancy",
    "loadtest.redteam.skipped",
    "loadtest.redteam.roles",
    "loadtest.redteam.hf3fs",
)
HEALTHZ_LIMIT_MS = 50.0


@dataclass
class Prober:
    """GET /healthz every `interval` s on one kept-alive connection per listener."""

    target: Target
    interval: float = 0.02
    seen: dict = field(default_factory=lambda: {"tcp": [], "unix": []})
    rss: list = field(default_factory=list)  # the sidecar's RSS (MiB), each round

    def __post_init__(self):
        port = int(self.target.url.rsplit(":", 1)[1])
        self.conns = {
            "tcp": http.client.HTTPConnection("127.0.0.1", port, timeout=30),
            "unix": UnixHTTPConnection(self.target.socket, timeout=30),
        }
        for conn in self.conns.values():
            self._probe(conn)  # connect now: a connection cap reached later must not refuse it
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _probe(self, conn) -> float:
        t0 = time.perf_counter()
        try:
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            resp.read()
            ok = resp.status == 200
        except (OSError, http.client.HTTPException):
            conn.close()
            ok = False
        return (time.perf_counter() - t0) * 1e3 if ok else float("inf")

    def _run(self) -> None:
        while not self.stop.is_set():
            for name, conn in self.conns.items():
                self.seen[name].append(self._probe(conn))
            self.rss.append(rss_mib(self.target.pid))
            self.stop.wait(self.interval)

    def summary(self) -> dict:
        out: dict[str, Any] = {}
        rss = [r for r in self.rss if r is not None]
        if rss:
            out["rss_mib"] = {"start": rss[0], "max": max(rss), "growth": max(rss) - rss[0]}
        for name, ms in self.seen.items():
            ms = sorted(ms)
            out[name] = {
                "probes": len(ms),
                "max_ms": ms[-1] if ms else None,
                "p99_ms": ms[int(0.99 * (len(ms) - 1))] if ms else None,
            }
        return out


def start_sidecar(attack: Attack, workdir: str) -> tuple[SidecarProcess, Target]:
    """The attack's sidecar; its socket dir and data dir beside `workdir`, the sidecar's."""
    own = os.path.join(os.path.dirname(workdir), "own")
    os.makedirs(own, 0o755)
    if attack.prepare is not None:
        attack.prepare(own)
    sock, token = os.path.join(own, "s.sock"), attack.token
    args = ["--socket-mode", "0666", "--log-level", "warning", "--host-pool", "64MiB"]
    args += ["--data-dir", os.path.join(own, "data")]
    args += [a.replace("{own}", own) for a in attack.sidecar_args]  # {own}: the sidecar's dir
    env = {"SIDECAR_TOKEN": token} if token else {}
    proc = SidecarProcess(*args, socket=sock, env=env).wait_ready()
    return proc, Target(proc.url, sock, token, proc.proc.pid, workdir)


def run_one(attack: Attack, seconds: float | None = None) -> dict:
    top = tempfile.mkdtemp(prefix="kv-redteam-")  # 0700, removed at the end
    workdir = os.path.join(top, "w")
    os.mkdir(workdir)
    os.chmod(top, 0o755)
    os.chmod(workdir, 0o1777)  # the attackers' (sticky)
    try:
        return _run(attack, seconds, workdir)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _run(attack: Attack, seconds: float | None, workdir: str) -> dict:
    proc, target = start_sidecar(attack, workdir)
    try:
        built = attack.setup(target) if attack.setup is not None else {}
        prober = Prober(target)
        prober.thread.start()
        stop = threading.Event()
        timer = threading.Timer(seconds or attack.seconds, stop.set)
        timer.start()
        try:
            facts = {**built, **attack.run(target, stop)}
        except Exception as exc:  # an attack that breaks is a finding, not a crash
            facts = {"held": False, "error": repr(exc)}
        finally:
            timer.cancel()
            stop.set()
            prober.stop.set()
            prober.thread.join(30)
        alive = proc.proc.poll() is None
    finally:
        proc.stop()
    health = prober.summary()
    rss = health.pop("rss_mib", None)
    fast = all(h["max_ms"] is not None and h["max_ms"] < HEALTHZ_LIMIT_MS for h in health.values())
    small = rss is not None and rss["growth"] < attack.rss_limit_mib
    kept = bool(facts.get("held")) and alive and fast and small
    return {
        "item": attack.item,
        "attack": attack.name,
        "kept": kept,
        "alive": alive,
        "healthz": health,
        "rss_mib": rss,
        **facts,
    }


def attacks() -> list[Attack]:
    out = []
    for name in MODULES:
        try:
            out += importlib.import_module(name).ATTACKS
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", help="attack names to run (default: all)")
    p.add_argument("--seconds", type=float, help="override each attack's duration")
    p.add_argument("--json", action="store_true", help="one JSON line per attack")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print(
            "the red-team runner attacks a root sidecar as uid nobody: run it as root",
            file=sys.stderr,
        )
        return 2
    rows = [run_one(a, args.seconds) for a in attacks() if not args.only or a.name in args.only]
    for r in rows:
        if args.json:
            print(json.dumps(r, default=str))
        else:
            h, rss = r["healthz"], r["rss_mib"] or {"growth": float("nan"), "max": float("nan")}
            print(
                f"{r['item']:>3} {r['attack']:<36} {'kept' if r['kept'] else 'BROKEN':<7}"
                f" healthz max unix {h['unix']['max_ms']:.1f} ms, tcp {h['tcp']['max_ms']:.1f} ms,"
                f" RSS +{rss['growth']:.1f} MiB (max {rss['max']:.0f})"
            )
    print(f"{sum(r['kept'] for r in rows)} kept, {sum(not r['kept'] for r in rows)} broken")
    return 0 if all(r["kept"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
