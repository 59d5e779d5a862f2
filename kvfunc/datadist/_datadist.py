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
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed import DistError

from kvfunc.core import LLMError, LLMStatusCode
from kvfunc.datadist import _push
from kvfunc.datadist._backends import Endpoint, TorchEndpoint, create_process_group
from kvfunc.datadist._cache_manager import CacheManager
from kvfunc.datadist._config import DataDistOptions, LLMClusterInfo
from kvfunc.datadist._errors import (
    ClusterNumExceedError,
    DataDistFailedError,
    FeatureNotEnabledError,
    InvalidParamError,
    LinkFailedError,
    NotLinkedError,
)
from kvfunc.datadist._link import ROOT, Acceptor, Link, LinkContext, connect
from kvfunc.datadist._pool import MemoryPool
from kvfunc.datadist._registry import RegistryState
from kvfunc.datadist._serving import Server
from kvfunc.datadist._tcp import TcpEndpoint
from kvfunc.datadist._types import (
    ClusterInfo,
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

    LLM-DataDist's form is ``LLMDataDist(role, cluster_id)`` then
    ``init(options)``; kvfunc also takes the options in the constructor.

    Args:
        role: ``LLMRole.PROMPT`` or ``LLMRole.DECODER``.
        cluster_id: this cluster's id (peers name it in keys and links).
        options: if given, ``init(options)`` is called at once.

    >>> dd = LLMDataDist(LLMRole.DECODER, 1)
    >>> dd.init({"ge.flowGraphMemMaxSize": "65536", "llm.Device": "cpu"})
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
        self._links: dict[int, Link] = {}
        self._retired: list[Link] = []  # closed by the peer: joined at finalize
        self._lock = threading.Lock()
        self._initialized = self._finalized = False
        self._acceptor: Acceptor | None = None
        if options is not None:
            self.init(options)

    def init(self, options: Mapping[str, object]) -> None:
        """Allocate the pools, start the transport and listen (if asked); once only.

        Args:
            options: see :class:`DataDistOptions` (``ge.flowGraphMemMaxSize``
                or ``llm.MemPoolConfig``, ``llm.listenIpInfo``,
                ``llm.SyncKvCacheWaitTime``, ...).

        Raises:
            InvalidParamError: an unknown option or a bad value (nothing started).
            LinkFailedError: the listening address cannot be bound.
        """
        self._check_open()
        if self._initialized:
            return
        opts = DataDistOptions.from_mapping(options)
        device = resolve_device(opts.device)
        if opts.device_id is not None and device.type != "cpu" and device.index is None:
            device = torch.device(device.type, opts.device_id)
        self.options, self.device = opts, device
        self.transport = opts.transport or _DEFAULT_TRANSPORT.get(device.type, "tcp")
        configs = {p: c for p, c in ((Placement.DEVICE, opts.device_pool),
                                     (Placement.HOST, opts.host_pool)) if c is not None}
        self._pool = MemoryPool(configs, device)
        state = RegistryState.create(self.role, self.cluster_id,
                                     {p: (c.memory_size, c.page_size) for p, c in configs.items()})
        self._timeout_s = opts.sync_timeout_ms / 1000
        self._cache_manager = CacheManager(state, self._pool, self._link_to, self._timeout_s)
        self._engine: Any = None
        session = None
        if self.transport == "mooncake":
            from kvfunc.datadist._mooncake import MooncakeEngine

            host = opts.listen[0] if opts.listen else "127.0.0.1"
            self._engine = MooncakeEngine(host, list(self._pool.buffers.values()))
            session = self._engine.session
        self._server = Server()
        self._ctx = LinkContext(self.cluster_id, self.role, self.transport, device,
                                self._timeout_s, session, self._make_endpoint,
                                lambda link, m: _push.dispatch(self._cache_manager, link, m),
                                self._on_up, self._on_down, self._server)
        self._initialized = True
        if opts.listen is not None:
            self._acceptor = Acceptor(self._ctx, *opts.listen)

    @property
    def cache_manager(self) -> CacheManager:
        """The cache manager (after :meth:`init`)."""
        self._check_init()
        return self._cache_manager

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
            return MooncakeEndpoint(self._engine, session, link.channel)
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
    def _clusters(clusters: Sequence[ClusterInfo | LLMClusterInfo], timeout: int
                  ) -> list[ClusterInfo]:
        if isinstance(clusters, ClusterInfo | LLMClusterInfo) or \
                not isinstance(clusters, Sequence) or \
                not all(isinstance(c, ClusterInfo | LLMClusterInfo) for c in clusters):
            raise InvalidParamError("clusters must be a list of ClusterInfo or LLMClusterInfo")
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            raise ClusterNumExceedError(f"{len(clusters)} clusters in one call; at most "
                                        f"{MAX_CLUSTERS_PER_CALL}")
        if type(timeout) is not int or timeout <= 0:
            raise InvalidParamError(f"timeout must be a positive number of ms, got {timeout!r}")
        return [c.to_cluster_info() if isinstance(c, LLMClusterInfo) else c for c in clusters]

    def link_clusters(self, clusters: Sequence[ClusterInfo | LLMClusterInfo],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to listening clusters (at most 16 per call), ``timeout`` ms each.

        Returns:
            ``(overall, per_cluster)`` status codes: ``LLM_SUCCESS``, or
            ``LLM_ALREADY_LINK`` / ``LLM_LINK_FAILED`` for a cluster.

        Raises:
            ClusterNumExceedError: more than 16 clusters.
            InvalidParamError: not a list of ``ClusterInfo``, bad timeout.
        """
        self._check_init()
        codes = []
        for cluster in self._clusters(clusters, timeout):
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

    def unlink_clusters(self, clusters: Sequence[ClusterInfo | LLMClusterInfo],
                        timeout: int = 3000, force: bool = False
                        ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Close links (at most 16 per call); the peer is told, if it is still there.

        ``force`` is accepted as LLM-DataDist's: this side's link always goes,
        whether or not the peer answers.

        Returns:
            ``(overall, per_cluster)``; ``LLM_NOT_YET_LINK`` for a cluster
            that was not linked.
        """
        if type(force) is not bool:
            raise InvalidParamError(f"force must be a bool, got {force!r}")
        codes = []
        for cluster in self._clusters(clusters, timeout):
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

    def _check_init(self) -> None:
        self._check_open()
        if not self._initialized:
            raise DataDistFailedError("this LLMDataDist is not initialized: call init(options)")

    def finalize(self) -> None:
        """Close every link, stop listening and release the pool (idempotent)."""
        if self._finalized:
            return
        self._finalized = True
        if not self._initialized:
            return
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
        self._server.shutdown(wait=True)
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> LLMDataDist:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()

    def __repr__(self) -> str:
        over = f"over {self.transport}" if self._initialized else "not initialized"
        return (f"<LLMDataDist {self.role.name} cluster {self.cluster_id} {over}, linked to "
                f"{list(self.linked_clusters())}>")


def _overall(codes: list[LLMStatusCode]) -> LLMStatusCode:
    failed = [c for c in codes if c is not LLMStatusCode.LLM_SUCCESS]
    return failed[0] if failed else LLMStatusCode.LLM_SUCCESS


