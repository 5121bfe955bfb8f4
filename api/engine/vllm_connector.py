"""vLLM KV connector backed by kv-sidecar (`KVConnectorBase_V1`).

    vllm serve MODEL --enable-prefix-caching --kv-transfer-config '{
      "kv_connector": "SidecarConnector", "kv_connector_module_path": "api.vllm_connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"sidecar_url": "unix:///run/kv-sidecar/sidecar.sock", "sidecar_token": "..."}}'

Keys are vLLM's own chained block hashes (hex): they already fold in the LoRA adapter and
the cache salt. The namespace names the rest of what makes pages interchangeable (model,
dtype, block size, backend and kernel path, tensor shapes, hash algorithm, TP/PP rank); the
worker computes it from its KV tensors and hands it to the scheduler in the startup
handshake. Nothing raises into the engine: a failure is a miss, a failed load is reported
through `get_block_ids_with_load_errors` and vLLM recomputes those blocks.

A prefix loads only when restoring it should beat computing it (api/engine/restore_cost.py,
`restore_cost`, on by default): the worker times its loads and the forwards and hands the
timings to the scheduler through vLLM's connector stats (`SidecarStats`).

Hybrid models (several KV cache groups: sliding window, Mamba / linear attention) go
through vLLM's hybrid KV cache manager (`SupportsHMA`): one namespace per group, each with
its pool kind and hit rule (`api.engine.vllm_groups`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # a vLLM without the hybrid allocator interface: one group only
    # vLLM types the class where it is installed (the dev venv sees Any): unused-ignore there
    SupportsHMA = object  # type: ignore[misc,assignment,unused-ignore]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # a vLLM without connector stats: no timings reach the scheduler
    # as above: the ignore is needed only where vLLM's types are seen
    KVConnectorStats = None  # type: ignore[misc,assignment,unused-ignore]

from api.engine.client import ENGINE_URL, SidecarClient
from api.engine.restore_cost import RestoreCost
from api.engine.vllm_groups import (
    MAMBA,
    HybridScheduler,
    HybridWorker,
    is_hybrid,
    kind_of,
    plan_groups,
    transfer_results_type,
)
from api.engine.vllm_layout import EngineScope, PageLayout, namespace_spec
from api.engine.vllm_scheduler import SchedulerSide, Transfer
from api.engine.vllm_timeline import Timeline
from api.engine.vllm_worker import KvArena, WorkerSide

log = logging.getLogger("kv_sidecar.vllm")
_CRYPTO_HASHES = ("sha256", "sha256_cbor")


@dataclass
class SidecarConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the pages to load before the forward and to save after."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    prefill: int = 0  # prompt tokens this step computes (0: not a prefill step)


if KVConnectorStats is not None:

    @dataclass
    class SidecarStats(KVConnectorStats):
        """The worker's timings for the scheduler's restore cost, as vLLM's connector
        stats carry them (worker -> scheduler, every step that has some)."""

        def reset(self) -> None:
            self.data: dict[str, list] = {"restores": [], "prefill": []}

        def aggregate(self, other) -> SidecarStats:
            for k, rows in (getattr(other, "data", None) or {}).items():
                self.data.setdefault(k, []).extend(rows)
            return self

        def reduce(self) -> dict:
            return {
                "sidecar_restores_timed": len(self.data.get("restores", ())),
                "sidecar_prefill_steps_timed": len(self.data.get("prefill", ())),
            }

        def is_empty(self) -> bool:
            return not any(self.data.values())
else:
    SidecarStats = None  # type: ignore[misc,assignment]


@dataclass
class SidecarHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: this rank's namespace and its spec (hybrid models:
    the first group's, and `groups`, every group's (namespace, spec) in group order)."""

    namespace: str
    spec: dict
    groups: list | None = None


def never_raises(default):
    """Log (rate-limited by the logger's config) and answer `default` instead of raising."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                log.exception("kv-sidecar connector %s failed (answering %r)", fn.__name__, default)
                return default() if callable(default) else default

        return inner

    return wrap


class SidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """kv_role "kv_both": loads the longest stored prefix, saves every new full block."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.extra = extra
        url = extra.get("sidecar_url") or os.environ.get("SIDECAR_URL", ENGINE_URL)
        token = extra.get("sidecar_token") or os.environ.get("SIDECAR_TOKEN")
        self.client = SidecarClient(
            url, token=token, timeout=float(extra.get("sidecar_timeout", 5.0))
        )
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.arena: KvArena | None = None
        self.hybrid: HybridWorker | None = None
        self.timeline = Timeline(extra.get("timeline") or None)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, kv_cache_config)

    # -- setup -------------------------------------------------------------------------
    def _init_scheduler(self, vllm_config, kv_cache_config) -> None:
        tc = self._kv_transfer_config
        if tc.kv_load_failure_policy != "recompute" and self.extra.get("on_load_error") != "fail":
            log.info(
                "kv-sidecar: a page that fails to load is a miss: kv_load_failure_policy=recompute"
            )
            tc.kv_load_failure_policy = "recompute"
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        mamba = any(kind_of(g.kv_cache_spec) == MAMBA for g in groups)
        tail_on = self._flag("load_last_block", True) and not mamba  # Mamba: states at block ends
        plans = None
        if is_hybrid(kv_cache_config):
            plans, why = plan_groups(kv_cache_config, tail=tail_on)
            if not plans:
                log.warning("kv-sidecar: unsupported KV cache groups (%s): disabled", why)
                return
            log.info(
                "kv-sidecar: %d KV cache groups: %s",
                len(plans),
                ", ".join(
                    f"{p.kind}" + (f" (window {p.window})" if p.window else "") for p in plans
                ),
            )
        elif len(groups) != 1:
            log.warning("kv-sidecar: no KV cache groups: disabled")
            return
        block_size = plans[0].block_size if plans else groups[0].kv_cache_spec.block_size
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
        if block_size % hash_block:
            log.warning(
                "kv-sidecar: block size %d is no multiple of the hash block size %d: disabled",
                block_size,
                hash_block,
            )
            return
        cache = vllm_config.cache_config
        if not cache.enable_prefix_caching:
            log.warning(
                "kv-sidecar: needs --enable-prefix-caching (keys are its block hashes): disabled"
            )
        algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
        if algo not in _CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
            log.warning(
                "kv-sidecar: %s block hashes get a random seed per process: set PYTHONHASHSEED "
                "(the same on every engine) or no engine finds another's pages",
                algo,
            )
        ratio = block_size // hash_block
        tail = self._tail_hasher(algo, block_size, ratio) if tail_on else None
        kw: dict[str, Any] = dict(
            ratio=ratio,
            lookup_wait=float(self.extra.get("lookup_wait_ms", 2.0)) / 1e3,
            lookup_timeout=float(self.extra.get("lookup_timeout_ms", 1000.0)) / 1e3,
            lookup_refresh=float(self.extra.get("lookup_refresh_ms", 500.0)) / 1e3,
            step_tokens=int(
                getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0
            ),
            tail_key=tail,
        )
        self.sched = (
            HybridScheduler(self.client, block_size, plans=plans, **kw)
            if plans
            else SchedulerSide(self.client, block_size, **kw)
        )
        self.sched.timeline = self.timeline
        if not plans and SidecarStats is not None and self._flag("restore_cost", True):
            self.sched.cost = RestoreCost(probe_s=float(self.extra.get("restore_probe_s", 60.0)))

    def _flag(self, key: str, default: bool) -> bool:
        value = self.extra.get(key, default)
        return (
            value
            if isinstance(value, bool)
            else str(value).lower() not in ("0", "false", "no", "off")
        )

    def _tail_hasher(self, algo: str, bs: int, ratio: int):
        """Key of a prompt's partial last block: vLLM's own block hash of its tokens (with the
        LoRA, multimodal and salt extra keys vLLM would use) chained on the last full block,
        with a suffix no full block's key has. None when vLLM's hash helpers are missing."""
        try:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import (
                generate_block_hash_extra_keys,
                hash_block_tokens,
            )

            hash_fn = get_hash_fn_by_name(algo)
        except Exception as exc:
            log.warning(
                "kv-sidecar: cannot hash partial blocks (%s): the last block of a prompt "
                "that does not end on a block boundary is computed",
                exc,
            )
            return None

        def tail_key(request, full: int) -> str | None:
            start, end = full * bs, request.num_tokens
            parent = request.block_hashes[full * ratio - 1] if full else None
            extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
            digest = hash_block_tokens(hash_fn, parent, request.all_token_ids[start:end], extra)
            return bytes(digest).hex() + "-tail"

        return tail_key

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost result

    # -- worker side -------------------------------------------------------------------
    @never_raises(None)
    def register_kv_caches(self, kv_caches: dict[str, Any]):
        num_blocks = self._kv_cache_config.num_blocks
        if is_hybrid(self._kv_cache_config):
            self._register_groups(dict(kv_caches), num_blocks)
            return
        self.worker = self._side(PageLayout.of(dict(kv_caches), num_blocks), kv_caches)

    def _register_groups(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """One `WorkerSide` per KV cache group: its layers' blocks, its namespace."""
        kcc = self._kv_cache_config
        plans, why = plan_groups(kcc, tail=False)
        if not plans:
            log.warning("kv-sidecar: unsupported KV cache groups (%s): disabled", why)
            return
        sides = []
        for plan, group in zip(plans, kcc.kv_cache_groups, strict=True):
            layers = {n: kv_caches[n] for n in group.layer_names if n in kv_caches}
            sides.append(
                self._side(PageLayout.of(layers, num_blocks), layers, plan.pool, plan.describe)
            )
        self.hybrid = HybridWorker(sides)

    def _side(self, layout: PageLayout, kv_caches, pool: str = "kv", group: str = "") -> WorkerSide:
        """The worker side of one namespace: these layers' pages (a group's, or all)."""
        cfg = self._vllm_config
        scope = EngineScope(
            model=self._model_id(),
            dtype=self._dtype(),
            block_size=cfg.cache_config.block_size,
            backend=self._backend(kv_caches),
            hashing=self._hashing(),
            rank=self._rank(),
        )
        kv_buffer = self.arena.holding(layout.views) if self.arena is not None else None
        if self.arena is not None and kv_buffer is None:
            log.warning(
                "kv-sidecar: the KV cache is not in the connector's memfd: loads go through staging"
            )
        staging = int(self.extra.get("staging_blocks", 0)) or self._default_staging(
            layout, kv_buffer is None
        )
        spec = namespace_spec(scope, layout, self.extra.get("sidecar_share_gid"), pool, group)
        side = WorkerSide(self.client, layout, spec, staging, kv_buffer)
        side.timeline = self.timeline
        log.info(
            "kv-sidecar: namespace %s (%s), %d-byte pages, %s",
            side.namespace,
            pool,
            layout.page_bytes,
            "cuda_ipc"
            if side.cuda
            else f"loads into the KV cache's memfd, {side.slots.capacity}-slot staging memfd for saves"
            if kv_buffer is not None
            else f"{side.slots.capacity}-slot staging memfd",
        )
        return side

    def get_mem_pool_context(self):
        """On CPU, vLLM's KV cache allocation runs in `KvArena`: the cache lands in a memfd
        the sidecar maps, and a load is one copy into the KV blocks (no staging)."""
        try:
            from vllm.platforms import current_platform

            if not current_platform.is_cpu() or not self._flag("kv_cache_in_memfd", True):
                return None
            self.arena = self.arena or KvArena()
            return self.arena
        except Exception:
            log.exception(
                "kv-sidecar: the KV cache stays in private memory (loads through staging)"
            )
            return None

    def _model_id(self) -> str:
        mc = self._vllm_config.model_config
        model = str(mc.model) + (f"@{mc.revision}" if getattr(mc, "revision", None) else "")
        scope = self.extra.get("sidecar_scope")
        return f"{model}#{scope}" if scope else model

    def _dtype(self) -> str:
        return (
            f"{self._vllm_config.model_config.dtype}/{self._vllm_config.cache_config.cache_dtype}"
        )

    def _hashing(self) -> str:
        algo = getattr(self._vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
        hash_block = getattr(self._kv_cache_config, "hash_block_size", None)
        return f"{algo}/{hash_block or self._vllm_config.cache_config.block_size}"

    def _backend(self, kv_caches) -> str:
        """Attention backend and kernel path of the first layer (CPU_ATTN sets `isa`)."""
        ctx = self._vllm_config.compilation_config.static_forward_context
        layer = ctx.get(next(iter(kv_caches)))
        backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: "unknown")()
        isa = getattr(layer, "isa", None)
        return f"{backend}.{isa}" if isa else str(backend)

    def _rank(self) -> dict:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pc = self._vllm_config.parallel_config
        dcp = getattr(pc, "decode_context_parallel_size", 1) or 1
        pcp = getattr(pc, "prefill_context_parallel_size", 1) or 1
        cp = 0  # context parallel (prefill x decode) shards the KV by token: one rank each
        if dcp > 1:
            from vllm.distributed.parallel_state import get_dcp_group

            cp = get_dcp_group().rank_in_group
        if pcp > 1:
            from vllm.distributed.parallel_state import get_pcp_group

            cp += get_pcp_group().rank_in_group * dcp
        return {
            "tp": get_tp_group().rank_in_group,
            "tp_size": pc.tensor_parallel_size,
            "pp": get_pp_group().rank_in_group,
            "pp_size": pc.pipeline_parallel_size,
            "cp": cp,
            "cp_size": dcp * pcp,
        }

    def _default_staging(self, layout: PageLayout, loads: bool = True) -> int:
        """Enough slots for two steps' saves (and, when loads use staging too, a long
        prompt's loads), at most 1 GiB."""
        sc = self._vllm_config.scheduler_config
        bs = self._vllm_config.cache_config.block_size
        want = 2 * (sc.max_num_batched_tokens // bs + 1)
        if loads:
            want += self._vllm_config.model_config.max_model_len // bs
        return max(8, min(want, (1 << 30) // layout.page_bytes))

    def get_handshake_metadata(self) -> SidecarHandshake | None:
        if self.hybrid is not None:
            groups = self.hybrid.groups
            return SidecarHandshake(groups[0][0], groups[0][1], groups)
        if self.worker is None:
            return None
        return SidecarHandshake(self.worker.namespace, self.worker.spec)

    @property
    def _sides(self):
        """What moves this worker's pages: one side per group (hybrid), or the one side."""
        return self.hybrid if self.hybrid is not None else self.worker

    @never_raises(None)
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._sides is not None and isinstance(meta, SidecarConnectorMetadata) and meta.loads:
            self._sides.load(meta.loads)
            # loads precede the forward: time it from here
            self._forward: float | None = time.monotonic()

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._forward = time.monotonic()  # the step starts (vLLM starts loads-free steps' at
        #                                    the forward's end): the forward's time is the prefill's

    def _time_prefill(self, meta) -> None:
        """Time a prefill step's forward (loads excluded) for the restore cost."""
        started, self._forward = getattr(self, "_forward", None), None
        if self.worker is None or started is None or not getattr(meta, "prefill", 0):
            return
        if self.worker.cuda:
            import torch

            torch.cuda.current_stream().synchronize()
        if not getattr(self, "_warm", False):  # the engine's first prefill pays one-time costs
            self._warm = True
            return
        self.worker.timing("prefill", [meta.prefill, time.monotonic() - started])

    @never_raises(None)
    def get_kv_connector_stats(self):
        timings = self.worker.take_timings() if self.worker is not None else None
        return SidecarStats(data=timings) if timings and SidecarStats is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return SidecarStats(data=dict(data or {})) if SidecarStats is not None else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saves copy every layer at once in wait_for_save

    @never_raises(None)
    def wait_for_save(self):
        meta = self._connector_metadata
        if self._sides is not None and isinstance(meta, SidecarConnectorMetadata):
            self._time_prefill(meta)
            self._sides.save(meta.saves)  # also when empty: it ends the step's load failures

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Hybrid models: loads are asynchronous to vLLM, reported done (and failed) here."""
        if self.hybrid is None:
            return super().get_transfer_results(finished_req_ids)
        try:
            saved, loaded, failed = self.hybrid.transfer_results(set(finished_req_ids))
        except Exception:
            log.exception("kv-sidecar get_transfer_results failed")
            saved, loaded, failed = set(), set(), set()
        return transfer_results_type()(
            finished_sending=saved, finished_recving=loaded, failed_recving=failed
        )

    @never_raises(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    @never_raises(None)
    def shutdown(self):
        if self.worker is not None:
            self.worker.close()
        if self.hybrid is not None:
            self.hybrid.close()
        if self.sched is not None:
            self.sched.close()
        self.timeline.flush()

    # -- scheduler side ----------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        if self.sched is None:
            return
        ranks = sorted(metadata.items())
        pc = self._vllm_config.parallel_config
        expected = pc.tensor_parallel_size * pc.pipeline_parallel_size
        if len(ranks) < expected or any(not isinstance(m, SidecarHandshake) for _, m in ranks):
            # a rank that cannot load would compute on KV it never received: no hits at all
            log.warning(
                "kv-sidecar: %d of %d workers have a namespace (see their log): disabled",
                len(ranks),
                expected,
            )
            return
        if isinstance(self.sched, HybridScheduler):
            if any(not m.groups or len(m.groups) != len(self.sched.plans) for _, m in ranks):
                log.warning(
                    "kv-sidecar: a worker registered no namespace per KV cache group: disabled"
                )
                return
            self.sched.ranks = [[ns for ns, _ in m.groups] for _, m in ranks]
            self.sched.specs = {ns: spec for _, m in ranks for ns, spec in m.groups}
            return
        self.sched.specs = {m.namespace: m.spec for _, m in ranks}

    @never_raises(None)
    def on_new_request(self, request) -> None:
        if self.sched is not None:
            self.sched.prefetch(request)  # the exists call runs while the request queues

    @never_raises((0, False))
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if self.sched is None:
            return 0, False
        n = self.sched.matched(request, num_computed_tokens)
        return n, bool(n) and self.sched.async_loads

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.sched is None:
            return
        block_ids = self.sched.block_ids(blocks.get_block_ids())
        try:
            self.sched.allocated(request, block_ids, num_external_tokens)
        except Exception:
            log.exception("kv-sidecar update_state_after_alloc failed: the request recomputes")
            if num_external_tokens > 0:
                self.sched.fail_load(request.request_id, block_ids)

    def build_connector_meta(self, scheduler_output) -> SidecarConnectorMetadata:
        if self.sched is None:
            return SidecarConnectorMetadata()
        loads = self.sched.take_loads(sum(scheduler_output.num_scheduled_tokens.values()))
        try:
            saves = self.sched.saves(scheduler_output.num_scheduled_tokens, self._block_ids_of)
        except Exception:
            log.exception("kv-sidecar: planning this step's saves failed (they are skipped)")
            saves = []
        prefill = 0
        try:
            prefill = self.sched.prefill_tokens(scheduler_output.num_scheduled_tokens)
        except Exception:
            log.exception("kv-sidecar: counting the step's prefill tokens failed")
        return SidecarConnectorMetadata(loads, saves, prefill)

    @never_raises(None)
    def update_connector_output(self, connector_output):
        if self.sched is None:
            return
        timings = getattr(getattr(connector_output, "kv_connector_stats", None), "data", None)
        if timings and self.sched.cost is not None:
            self.sched.observe(timings)
        failed = getattr(connector_output, "failed_recving", None)
        if failed:
            self.sched.loads_failed(set(failed))
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self.sched.load_failed(set(invalid), self._block_ids_of)

    def _block_ids_of(self, rid: str) -> list:
        """A request's block ids now, as the scheduler side plans with them."""
        if self.sched is None:  # no scheduler side: no blocks to plan with
            return []
        return self.sched.block_ids(self._kv_cache_manager.get_block_ids(rid))

    @never_raises((False, None))
    def request_finished(self, request, block_ids):
        """Free the blocks at once (never delayed for saves: see `SchedulerSide.finished`)."""
        if self.sched is not None:
            self.sched.finished(request)
        return False, None

    @never_raises((False, None))
    def request_finished_all_groups(self, request, block_ids):
        """`SupportsHMA`: the same as `request_finished` (the saves cover every group)."""
        return self.request_finished(request, block_ids)
