"""``LLMDataDist``: one cluster's pool, cache manager and links to its peers.

A PROMPT cluster usually listens (``llm.listenIpInfo``) and DECODER
clusters link to it; either role may listen or link, but a link always
joins a PROMPT and a DECODER cluster.  One transport per cluster
(``llm.TransferBackend``): the link's own TCP connection (``tcp``, the
default for host memory), a ``torch.distributed`` process group per link
(gloo, nccl, hccl) or the Mooncake transfer engine.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed import DistError

from kvfunc.core import LLMError, LLMStatusCode
from kvfunc.datadist import _transfer
from kvfunc.datadist._backends import Endpoint, TorchEndpoint, create_process_group
from kvfunc.datadist._cache_manager import CacheManager
from kvfunc.datadist._errors import (
    ClusterNumExceedError,
    FeatureNotEnabledError,
    InvalidParamError,
    LinkFailedError,
    NotLinkedError,
)
from kvfunc.datadist._link import ROOT, Acceptor, Link, LinkContext, connect
from kvfunc.datadist._pool import MemoryPool
from kvfunc.datadist._registry import RegistryState
from kvfunc.datadist._tcp import TcpEndpoint
from kvfunc.datadist._types import (
    ClusterInfo,
    DataDistOptions,
    LLMRole,
    Placement,
    check_id,
)
from kvfunc.shell import resolve_device

__all__ = ["MAX_CLUSTERS_PER_CALL", "LLMDataDist"]

MAX_CLUSTERS_PER_CALL = 16
_DEFAULT_TRANSPORT = {"cpu": "tcp", "cuda": "nccl", "npu": "hccl"}


class LLMDataDist:
    """A prefill (PROMPT) or decode (DECODER) cluster of LLM-DataDist.

    Args:
        role: ``LLMRole.PROMPT`` or ``LLMRole.DECODER``.
        cluster_id: this cluster's id (peers name it in keys and links).
        options: see :class:`DataDistOptions` (``llm.MemPoolConfig``,
            ``llm.listenIpInfo``, ``llm.SyncKvCacheWaitTime``, ...).

    >>> dd = LLMDataDist(LLMRole.DECODER, 1, {"llm.MemPoolConfig": '{"memory_size": 65536}',
    ...                                       "llm.Device": "cpu"})
    >>> dd.cache_manager.state.pools[Placement.DEVICE].size, dd.linked_clusters()
    (65536, ())
    >>> dd.finalize()
    """

    def __init__(self, role: LLMRole, cluster_id: int,
                 options: Mapping[str, object] | None = None) -> None:
        if not isinstance(role, LLMRole):
            raise InvalidParamError(f"role must be an LLMRole, got {role!r}")
        check_id("cluster_id", cluster_id)
        self.role, self.cluster_id = role, cluster_id
        self.options = opts = DataDistOptions.from_mapping(options)
        self.device = resolve_device(opts.device)
        self.transport = opts.transport or _DEFAULT_TRANSPORT.get(self.device.type, "tcp")
        configs = {p: c for p, c in ((Placement.DEVICE, opts.device_pool),
                                     (Placement.HOST, opts.host_pool)) if c is not None}
        self._pool = MemoryPool(configs, self.device)
        state = RegistryState.create(role, cluster_id, {p: (c.memory_size, c.page_size)
                                                        for p, c in configs.items()})
        self._timeout_s = opts.sync_timeout_ms / 1000
        self._links: dict[int, Link] = {}
        self._retired: list[Link] = []  # closed by the peer: joined at finalize
        self._lock = threading.Lock()
        self._finalized = False
        self.cache_manager = CacheManager(state, self._pool, self._link_to, self._timeout_s)
        self._engine: Any = None
        session = None
        if self.transport == "mooncake":
            from kvfunc.datadist._mooncake import MooncakeEngine

            host = opts.listen[0] if opts.listen else "127.0.0.1"
            self._engine = MooncakeEngine(host, list(self._pool.buffers.values()))
            session = self._engine.session
        self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvfunc-serve")
        self._ctx = LinkContext(cluster_id, role, self.transport, self.device, self._timeout_s,
                                session, self._make_endpoint,
                                lambda link, m: _transfer.dispatch(self.cache_manager, link, m),
                                self._on_up, self._on_down, self._executor)
        self._acceptor = None if opts.listen is None else Acceptor(self._ctx, *opts.listen)

    @property
    def kv_cache_manager(self) -> CacheManager:
        """The cache manager (LLM-DataDist's older name for it)."""
        return self.cache_manager

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(host, port)`` this cluster accepts links on, or None."""
        return None if self._acceptor is None else (self._acceptor.host, self._acceptor.port)

    def linked_clusters(self) -> tuple[int, ...]:
        """Ids of the clusters linked now."""
        with self._lock:
            return tuple(sorted(self._links))

    # -- links ---------------------------------------------------------------------------
    def _make_endpoint(self, link: Link, session: str | None) -> Endpoint:
        if self.transport == "mooncake":
            from kvfunc.datadist._mooncake import MooncakeEndpoint

            if session is None:
                raise LinkFailedError("the peer announced no Mooncake session")
            return MooncakeEndpoint(self._engine, session)
        if self.transport == "tcp":
            return TcpEndpoint(link.channel)
        try:
            store = TCPStore(link.host, link.store_port, is_master=False,
                             timeout=datetime.timedelta(seconds=self._timeout_s))
        except (DistError, RuntimeError) as exc:
            raise LinkFailedError(f"cannot reach the rendezvous store: {exc}") from None
        prefix = PrefixStore(f"{ROOT}/link/{link.link_id}/pg", store)
        group = create_process_group(self.transport, prefix, link.rank, self._timeout_s)
        return TorchEndpoint(group, self.transport, link.rank, self.device)

    def _on_up(self, link: Link) -> None:
        with self._lock:
            old = self._links.get(link.peer_cluster_id)
            self._links[link.peer_cluster_id] = link
        if old is not None:  # the peer restarted and linked again
            old.close(notify_peer=False)
            with self._lock:
                self._retired.append(old)

    def _on_down(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.peer_cluster_id) is link:
                del self._links[link.peer_cluster_id]
            self._retired.append(link)

    def _link_to(self, cluster_id: int) -> Link:
        check_id("cluster_id", cluster_id)
        with self._lock:
            link = self._links.get(cluster_id)
        if link is None:
            raise NotLinkedError(f"cluster {cluster_id} is not linked to cluster "
                                 f"{self.cluster_id}")
        return link

    @staticmethod
    def _clusters(clusters: Sequence[ClusterInfo], timeout: int) -> None:
        if isinstance(clusters, ClusterInfo) or not isinstance(clusters, Sequence) or \
                not all(isinstance(c, ClusterInfo) for c in clusters):
            raise InvalidParamError("clusters must be a list of ClusterInfo")
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            raise ClusterNumExceedError(f"{len(clusters)} clusters in one call; at most "
                                        f"{MAX_CLUSTERS_PER_CALL}")
        if type(timeout) is not int or timeout <= 0:
            raise InvalidParamError(f"timeout must be a positive number of ms, got {timeout!r}")

    def link_clusters(self, clusters: Sequence[ClusterInfo], timeout: int = 3000
                      ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to listening clusters (at most 16 per call), ``timeout`` ms each.

        Returns:
            ``(overall, per_cluster)`` status codes: ``LLM_SUCCESS``, or
            ``LLM_ALREADY_LINK`` / ``LLM_LINK_FAILED`` for a cluster.

        Raises:
            ClusterNumExceedError: more than 16 clusters.
            InvalidParamError: not a list of ``ClusterInfo``, bad timeout.
        """
        self._check_open()
        self._clusters(clusters, timeout)
        codes = []
        for cluster in clusters:
            if cluster.remote_cluster_id in self.linked_clusters():
                codes.append(LLMStatusCode.LLM_ALREADY_LINK)
                continue
            try:
                link = connect(self._ctx, cluster, timeout / 1000)
            except LLMError as exc:
                codes.append(exc.status_code)
                continue
            self._on_up(link)
            codes.append(LLMStatusCode.LLM_SUCCESS)
        return _overall(codes), codes

    def unlink_clusters(self, clusters: Sequence[ClusterInfo], timeout: int = 3000
                        ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Close links (at most 16 per call); the peer is told, if it is still there.

        Returns:
            ``(overall, per_cluster)``; ``LLM_NOT_YET_LINK`` for a cluster
            that was not linked.
        """
        self._clusters(clusters, timeout)
        codes = []
        for cluster in clusters:
            with self._lock:
                link = self._links.pop(cluster.remote_cluster_id, None)
            if link is None:
                codes.append(LLMStatusCode.LLM_NOT_YET_LINK)
                continue
            link.close(notify_peer=True)
            with self._lock:
                self._retired.append(link)
            codes.append(LLMStatusCode.LLM_SUCCESS)
        return _overall(codes), codes

    def _check_open(self) -> None:
        if self._finalized:
            raise FeatureNotEnabledError("this LLMDataDist was finalized")

    def finalize(self) -> None:
        """Close every link, stop listening and release the pool (idempotent)."""
        if self._finalized:
            return
        self._finalized = True
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close(notify_peer=True, wait=True)
        for link in self._retired:
            link.close(notify_peer=False)
            link.join()
        if self._acceptor is not None:
            self._acceptor.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> LLMDataDist:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()

    def __repr__(self) -> str:
        return (f"<LLMDataDist {self.role.name} cluster {self.cluster_id} over "
                f"{self.transport}, linked to {list(self.linked_clusters())}>")


def _overall(codes: list[LLMStatusCode]) -> LLMStatusCode:
    failed = [c for c in codes if c is not LLMStatusCode.LLM_SUCCESS]
    return failed[0] if failed else LLMStatusCode.LLM_SUCCESS


