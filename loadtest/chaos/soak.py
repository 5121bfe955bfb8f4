"""Chaos soak: engine-shaped Locust traffic on real sidecars while a seeded driver breaks them.

    python -m loadtest.chaos.soak --seed 7 --duration 600 [--workdir DIR] [--events] [--tiers 3fs]

Two sidecar processes (a write_through one and a write_back one, two namespaces each) keep
their file tier on a small tmpfs (root; else a plain directory, said in the summary). Locust
users (in this process) drive them over the engine socket while the driver, every few
seconds, injects one fault, cycling the kinds in a seeded order:

    sigkill     SIGKILL, restart on the same socket and data dir, check the node
    sigterm     SIGTERM (must exit 0 and write what it acknowledged), restart, check
    disk_fill   a filler file takes every free byte of the tier's filesystem, released later
    ns_delete   DELETE a namespace under traffic, create it again, check nothing came back
    stall       half-sent PUT bodies stall on the TCP port; a set of a stalled key must keep

A flusher answers `POST /v1/flush` every 2 s (a 200 makes write_through pages durable).
At the end the users stop, every node is checked, stopped with SIGTERM, started and checked
again. `--events` turns KV events on in both (`ipc://` sockets in the workdir, no
subscriber); `--tiers 3fs` gives both one shared 3FS dir on the same disk as well (its
writes killed, filled, deleted under and restarted with the rest). Exit status 1 on any
violation (see ledger.VIOLATIONS); the last line printed is `CHAOS-SUMMARY {json}`.
"""

from __future__ import annotations

import contextlib

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
from locust import between  # noqa: E402
from locust.env import Environment  # noqa: E402

from api.engine.client import SidecarClient, SidecarError, SidecarUnavailable  # noqa: E402
from api.engine.shm import SharedBuffer, page_first_chunks  # noqa: E402
from loadtest.chaos.faults import Disk, NodeSidecar, stall_uploads  # noqa: E402
from loadtest.chaos.ledger import VIOLATIONS, Ledger, Node  # noqa: E402
from loadtest.chaos.traffic import ChaosEngine, SecondTenant, World  # noqa: E402
from sidecar.config import parse_size  # noqa: E402

KINDS = ("sigkill", "sigterm", "disk_fill", "ns_delete", "stall")
BATCH = 256


class Soak:
    """The nodes, the world the users share, the fault log and the checks."""

    def __init__(self, args):
        self.args, self.rng = args, random.Random(args.seed)
        self.workdir = args.workdir or tempfile.mkdtemp(prefix="kv-chaos-")
        self.disk = Disk(os.path.join(self.workdir, "tier"), parse_size(args.disk_size))
        self.ledger = Ledger(args.seed, args.page_bytes)
        tier_cap = str(int(self.disk.size * 0.4))  # each; pages of 4 KiB take 8 KiB on disk
        extra = [
            "--host-pool",
            args.host_pool,
            "--file-tier-size",
            tier_cap,
            "--shutdown-timeout",
            "30",
        ]
        if args.tiers == "3fs":  # both nodes also share one 3FS dir on the same small disk
            extra += ["--hf3fs-dir", os.path.join(self.disk.root, "3fs"), "--hf3fs-size"]
            extra.append(str(int(self.disk.size * 0.1)))
        self.procs = {}
        for name, policy in (("wt", "write_through"), ("wb", "write_back")):
            node = Node(name, policy)
            # write_through with a short write queue: sets wait for room while the other
            # tenant's sets evict (issue 26, item 1: acknowledged pages lost there before)
            more = ["--write-queue-pages", "8"] if policy == "write_through" else []
            if args.events:  # KV events on ipc:// sockets in the (private) workdir
                ev = os.path.join(self.workdir, f"{name}-ev")
                more += [
                    "--kv-events",
                    f"ipc://{ev}.pub",
                    "--kv-events-replay",
                    f"ipc://{ev}.replay",
                    "--kv-events-buffer-bytes",
                    "8MiB",
                ]
            self.procs[name] = NodeSidecar(
                node,
                os.path.join(self.disk.root, name),
                os.path.join(self.workdir, f"{name}.log"),
                extra + more,
            )
        self.tenant = None
        self.faults: list[dict] = []
        self.filling, self.fill_epoch, self.busy = False, 0, set()
        self.world: World | None = None

    # -- setup --------------------------------------------------------------------------
    def start(self) -> None:
        namespaces = {}
        for name, sp in self.procs.items():
            sp.start()
            for ns in (f"{name}-a", f"{name}-b"):
                namespaces[ns] = {"url": sp.url, "tcp": sp.tcp, "node": sp.node, "proc": sp}
                self.ledger.owner[ns] = sp.node
        self.world = World(self.ledger, self.args.page_bytes, namespaces)
        for ns in namespaces:
            self.client(ns).put_namespace(ns, self.args.page_bytes, **self.world.spec(ns))
        self.tenant = SecondTenant(self, self.procs["wt"])

    def client(self, ns: str) -> SidecarClient:
        """A client on the engine socket: namespaces are made and dropped by their owner
        (the engines' uid), as engines do (docs/security.md, "Tenants")."""
        return SidecarClient(self.world.namespaces[ns]["url"], timeout=60)

    # -- checks -------------------------------------------------------------------------
    def check(self, sp: NodeSidecar, before: float) -> None:
        """Get every settled page of `sp` and judge it (over its engine socket)."""
        self.ledger.counts["checks"] += 1
        for ns, info in self.world.namespaces.items():
            if info["proc"] is not sp:
                continue
            pages = [p for p in self.ledger.settled(sp.node, before) if p.ns == ns]
            self._check_ns(sp, ns, pages)

    def _check_ns(self, sp: NodeSidecar, ns: str, pages: list) -> None:
        pb = self.args.page_bytes
        client = SidecarClient(sp.url, timeout=60)
        buf = SharedBuffer(BATCH * pb, name="chaos-check")
        try:
            client.put_namespace(ns, pb, **self.world.spec(ns))
            bid = buf.register(client, ns, BATCH, page_first_chunks(pb))
            for i in range(0, len(pages), BATCH):
                self.poll(sp)  # the tier's evictions so far bound its misses
                part, sent = pages[i : i + BATCH], self.world.now()
                loaded = self._get(client, ns, [p.key for p in part], bid)
                if loaded is None:
                    continue  # counted: an error is no verdict on the pages
                for slot, (page, ok) in enumerate(zip(part, loaded, strict=True)):
                    if ok:
                        self.ledger.served(ns, page.key, buf.view(slot * pb, pb))
                    if page.inflight or page.last_start >= sent or (page.deleted_at or 0) >= sent:
                        continue  # a user set or deleted it during the get
                    self.ledger.judge(sp.node, page, bool(ok))
            client.release_buffer(ns, bid)
        finally:
            client.close_leases()
            client.close()
            buf.close()

    def _get(self, client, ns, keys, bid) -> list[bool] | None:
        try:
            return client.get(ns, keys, bid, list(range(len(keys))))
        except SidecarError as e:
            self.world.failed(e, "check get", self.ledger.owner[ns].name)
        except SidecarUnavailable as e:
            self.ledger.note("check_unavailable", str(e)[:160], node=self.ledger.owner[ns].name)
        return None

    # -- the flusher --------------------------------------------------------------------
    def flusher(self) -> None:
        while True:
            gevent.sleep(2)
            for sp in self.procs.values():
                if sp.node.name not in self.busy:
                    self._flush(sp)

    def _flush(self, sp: NodeSidecar) -> None:
        c = SidecarClient(sp.tcp, timeout=60)
        try:
            sp.node.poll(c.stats())
            epoch, before, start = self.fill_epoch, sp.node.failed_seen, self.world.now()
            status, body = c.request("POST", "/v1/flush?timeout=30", ok=(504,))
            if (
                status == 200
                and body.get("failed", 0) == before
                and not self.filling
                and epoch == self.fill_epoch
                and sp.node.name not in self.busy
            ):
                self.ledger.flushed(sp.node, start)
        except SidecarUnavailable:
            pass
        except SidecarError as e:
            self.world.failed(e, "flush", sp.node.name)
        finally:
            c.close()

    # -- faults -------------------------------------------------------------------------
    def record(self, kind: str, target: str, **more) -> dict:
        f = {"t": round(self.world.now(), 3), "kind": kind, "target": target, **more}
        self.faults.append(f)
        print(f"  {f['t']:8.1f}s  {kind:9s} {target} {more or ''}", flush=True)
        return f

    def poll(self, sp: NodeSidecar) -> None:
        c = SidecarClient(sp.tcp, timeout=30)
        try:
            sp.node.poll(c.stats())
        except (SidecarUnavailable, SidecarError):
            pass
        finally:
            c.close()

    def restart(self, sp: NodeSidecar, how: str) -> None:
        self.busy.add(sp.node.name)
        try:
            self.poll(sp)
            if how == "sigkill":
                sp.node.stops.append((self.world.now(), "sigkill"))
                sp.kill()
                f = self.record("sigkill", sp.node.name)
            else:
                t = self.world.now()
                rc = sp.terminate()
                f = self.record(
                    "sigterm", sp.node.name, rc=rc, stop_s=round(self.world.now() - t, 2)
                )
                # a set sent before the exit and answered true was owed a write
                sp.node.stops.append((self.world.now(), "sigterm" if rc == 0 else "sigkill"))
                if rc != 0:
                    self.ledger.note("bad_exit", f"SIGTERM exit {rc}", node=sp.node.name)
            stopped = self.world.now()
            sp.start()
            f["down_s"] = round(self.world.now() - stopped, 2)
            self.check(sp, stopped)
        finally:
            self.busy.discard(sp.node.name)

    def disk_fill(self) -> None:
        for sp in self.procs.values():
            self._flush(sp)
        self.filling = True
        self.fill_epoch += 1
        start = self.world.now()
        self.ledger.disk_filled()
        taken = self.disk.fill()
        hold = self.rng.uniform(2, 5)
        self.record("disk_fill", self.disk.mode.split()[0], bytes=taken, hold_s=round(hold, 1))
        gevent.sleep(hold)
        self.disk.release()
        for sp in self.procs.values():
            self.poll(sp)
            c = SidecarClient(sp.tcp, timeout=60)
            with contextlib.suppress(SidecarUnavailable, SidecarError):
                c.request("POST", "/v1/flush?timeout=30", ok=(504,))
            c.close()
        self.ledger.taint_since(start)
        self.fill_epoch += 1
        self.filling = False
        for sp in self.procs.values():  # what a failed write lost is missing now
            self.check(sp, self.world.now())

    def ns_delete(self, ns: str) -> None:
        """DELETE a namespace of the soak's own engines under traffic, create it again."""
        w, c = self.world, self.client(ns)
        w.gen[ns] = w.gen.get(ns, 0) + 1
        start = w.now()
        try:
            c.delete_namespace(ns)
        except SidecarError as e:
            w.failed(e, "delete namespace", w.namespaces[ns]["node"].name)
        end = w.now()
        self.ledger.deleted(ns, None, start, end)
        c.put_namespace(ns, self.args.page_bytes, **w.spec(ns))
        c.close()
        self.record("ns_delete", ns, took_s=round(end - start, 3))
        self.check(w.namespaces[ns]["proc"], end)

    def stall(self, sp: NodeSidecar) -> None:
        n = len(self.faults)
        ns = f"{sp.node.name}-{self.rng.choice('ab')}"
        keys = [f"stall-{n}-{i}" for i in range(4)]
        socks = stall_uploads(sp.sock, ns, keys, [self.ledger.bytes_of(ns, k) for k in keys])
        hold = self.rng.uniform(2, 5)
        f = self.record("stall", ns, uploads=len(socks), hold_s=round(hold, 1))
        gevent.sleep(0.3)
        stored = f["set_stored"] = self._set_one(sp, ns, keys[0])
        gevent.sleep(hold)
        for s in socks:
            s.close()
        gevent.sleep(0.5)
        c = SidecarClient(sp.url, timeout=30)
        try:
            page = c.get_page(ns, keys[0])
        except (SidecarUnavailable, SidecarError):
            page = b""
        c.close()
        f["after"] = "present" if page else "missing" if page is None else "error"
        if page:
            self.ledger.served(ns, keys[0], page)
        elif stored and page is None:
            self.ledger.note("stalled_set_lost", f"{ns}/{keys[0]}", node=sp.node.name)
        self.ledger.unknown(ns, [keys[0]])  # judged here, not again

    def _set_one(self, sp: NodeSidecar, ns: str, key: str) -> bool:
        """A set, over shm, of a key whose upload is stalled; recorded in the ledger."""
        pb, w = self.args.page_bytes, self.world
        c = SidecarClient(sp.url, timeout=30)
        buf = SharedBuffer(pb, name="chaos-stall")
        try:
            bid = buf.register(c, ns, 1, page_first_chunks(pb))
            buf.view(0, pb)[:] = self.ledger.bytes_of(ns, key)
            start = w.now()
            self.ledger.set_started(ns, [key], start)
            try:
                stored = c.set(ns, [key], bid, [0])
            except (SidecarUnavailable, SidecarError) as e:
                if isinstance(e, SidecarError):
                    w.failed(e, "stalled-key set", sp.node.name)
                stored = None
            self.ledger.set_done(ns, [key], stored, start, w.now())
            c.release_buffer(ns, bid)
            return bool(stored and stored[0])
        except (SidecarUnavailable, SidecarError):
            return False
        finally:
            c.close_leases()
            c.close()
            buf.close()

    def inject(self, kind: str) -> None:
        sp = self.procs[self.rng.choice(sorted(self.procs))]
        if kind in ("sigkill", "sigterm"):
            self.restart(sp, kind)
        elif kind == "disk_fill":
            self.disk_fill()
        elif kind == "ns_delete":
            self.ns_delete(self.rng.choice(self.world.engine_namespaces()))
        else:
            self.stall(sp)

    def drive(self, until: float) -> None:
        """One fault after another, kinds cycled in a seeded order, until `until`."""
        gap = self.args.gap or min(20.0, max(2.0, self.args.duration / 16))
        order: list[str] = []
        while self.world.now() + gap < until or len({f["kind"] for f in self.faults}) < len(KINDS):
            gevent.sleep(self.rng.uniform(0.5 * gap, 1.5 * gap))
            if not order:
                order = list(KINDS)
                self.rng.shuffle(order)
            self.inject(order.pop())

    # -- the end ------------------------------------------------------------------------
    def finish(self) -> None:
        """Check every node running, stop each cleanly, start and check it again, stop."""
        self.tenant.stop()
        for sp in self.procs.values():
            self._flush(sp)
            self.check(sp, self.world.now())
        for sp in self.procs.values():
            self.busy.add(sp.node.name)
            self.poll(sp)
            rc = sp.terminate()
            sp.node.stops.append((self.world.now(), "sigterm" if rc == 0 else "sigkill"))
            if rc != 0:
                self.ledger.note("bad_exit", f"final SIGTERM exit {rc}", node=sp.node.name)
            stopped = self.world.now()
            sp.start()
            self.check(sp, stopped)
        for sp in self.procs.values():
            self.poll(sp)
            rc = sp.terminate()
            if rc != 0:
                self.ledger.note("bad_exit", f"last SIGTERM exit {rc}", node=sp.node.name)
        temps = self.disk.temps()
        if temps:
            self.ledger.note("temps_left", temps[0], len(temps))

    def close(self) -> None:
        if self.tenant is not None:
            self.tenant.stop()
        for sp in self.procs.values():
            sp.close()
        self.disk.close()


def summary(soak: Soak, elapsed: float) -> dict:
    led, w = soak.ledger, soak.world
    kinds = {k: sum(f["kind"] == k for f in soak.faults) for k in KINDS}
    violations = {k: led.counts.get(k, 0) for k in (*VIOLATIONS, "bad_exit", "check_unavailable")}
    bound = {
        sp.node.name: parse_size(soak.args.host_pool) // soak.args.page_bytes + 256
        for sp in soak.procs.values()
    }
    return {
        "seed": soak.args.seed,
        "tiers": soak.args.tiers,
        "duration_s": round(elapsed, 1),
        "disk": soak.disk.mode,
        "requests": w.counts["requests"],
        "unavailable": w.counts["unavailable"],
        "http_4xx": w.counts["http_4xx"],
        "no_room_507": w.counts["no_room_507"],
        "not_ready_503": w.counts["not_ready_503"],
        "gone_404": w.counts["gone_404"],
        "faults": kinds,
        "faults_total": len(soak.faults),
        "pages": len(led.pages),
        "pages_checked": led.counts["pages_checked"],
        "checks": led.counts["checks"],
        "losses": sum(
            v for k, v in violations.items() if k.startswith("lost") or k == "stalled_set_lost"
        ),
        "violations": violations,
        "violations_by_node": led.by_node,
        "allowed": {
            "sigkill_not_durable": led.counts["allowed_sigkill"],
            "disk_full_not_durable": led.counts["allowed_disk_full"],
            "evicted_by_tier": led.counts["evicted_by_tier"],
            "sigkill_bound_per_kill": bound,
        },
        "tier": {
            sp.node.name: {
                "evictions": sp.node.tier_evictions,
                "write_failed": sp.node.failed,
                "write_dropped": sp.node.dropped,
                "incarnations": sp.incarnations,
                "hf3fs_pages_max": sp.node.hf3fs_pages,
            }
            for sp in soak.procs.values()
        },
        "tenants": {
            "engines": f"this process (uid {os.geteuid()})",
            "second": soak.tenant.describe() if soak.tenant else None,
        },
        "fault_log": soak.faults,
        "examples": led.examples,
        "errors_4xx": w.errors[:10],
        "workdir": soak.workdir,
    }


def run(args) -> int:
    logging.getLogger("locust").setLevel(logging.WARNING)
    soak, t0 = Soak(args), time.monotonic()
    print(
        f"chaos soak: seed {args.seed}, {args.duration:.0f} s, disk {soak.disk.mode}, "
        f"workdir {soak.workdir}",
        flush=True,
    )
    try:
        soak.start()
        ChaosEngine.world = soak.world
        ChaosEngine.wait_time = between(0.5 * args.think, 1.5 * args.think)
        user = type("Engine", (ChaosEngine,), {"abstract": False})
        env = Environment(user_classes=[user], host=soak.procs["wt"].url)
        runner = env.create_local_runner()
        runner.start(args.users, spawn_rate=args.users)
        flusher = gevent.spawn(soak.flusher)
        soak.drive(args.duration)
        gevent.sleep(max(0.0, args.duration - soak.world.now()))
        runner.quit()
        flusher.kill()
        soak.finish()
    finally:
        soak.close()
    out = summary(soak, time.monotonic() - t0)
    print_summary(out)
    if not args.keep and out["workdir"].startswith(tempfile.gettempdir()) and not args.workdir:
        shutil.rmtree(out["workdir"], ignore_errors=True)
    return 1 if any(out["violations"].values()) else 0


def print_summary(out: dict) -> None:
    print(
        f"duration {out['duration_s']} s | requests {out['requests']} (unavailable during restarts "
        f"{out['unavailable']}, 503 not_ready {out['not_ready_503']}, 404 {out['gone_404']}, "
        f"other 4xx {out['http_4xx']}, "
        f"507 {out['no_room_507']})"
    )
    print(
        "faults "
        + ", ".join(f"{k} {v}" for k, v in out["faults"].items())
        + f" (total {out['faults_total']})"
    )
    print(
        f"pages {out['pages']}, checked {out['pages_checked']} in {out['checks']} checks, "
        f"losses {out['losses']}"
    )
    print("violations " + ", ".join(f"{k} {v}" for k, v in out["violations"].items()))
    print(f"violations by node {out['violations_by_node']}")
    print(f"allowed by design {out['allowed']}")
    print(f"tier {out['tier']}")
    for e in out["errors_4xx"]:
        print(f"  4xx: {e}")
    for k, ex in out["examples"].items():
        print(f"  e.g. {k}: {ex}")
    print("CHAOS-SUMMARY " + json.dumps(out), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.chaos.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic and faults")
    p.add_argument("--workdir", help="keep tiers and logs here (default: a temp dir, removed)")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--host-pool", default="16MiB")
    p.add_argument("--disk-size", default="1GiB", help="the tiers' tmpfs (both sidecars)")
    p.add_argument(
        "--think", type=float, default=0.1, help="mean seconds each user waits between tasks"
    )
    p.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="mean seconds between faults (default: duration/16, 2..20)",
    )
    p.add_argument(
        "--tiers",
        choices=("file", "3fs"),
        default="file",
        help="file: the file tier; 3fs: also a 3FS tier both nodes share (slotted, issue 55)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temp workdir")
    p.add_argument(
        "--events", action="store_true", help="KV events on (ipc:// sockets, no subscriber)"
    )
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
