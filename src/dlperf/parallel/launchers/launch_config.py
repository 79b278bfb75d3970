"""The settings of a process launch, checked once: what :class:`~.ProcessLauncher` is built from."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...errors import UsageError

__all__ = ["MAX_TIMEOUT_S", "MIN_TIMEOUT_S", "RUN_TIMEOUT_S", "LaunchConfig"]

# bounded: torch turns timeouts into timedeltas (1e300 s overflows) and whole seconds (1e-9 s is 0)
MIN_TIMEOUT_S = 0.01
MAX_TIMEOUT_S = 365 * 24 * 3600.0
RUN_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest a launched training run may take (and one collective wait) unless told otherwise: a week."""


@dataclass(frozen=True)
class LaunchConfig:
    """How many workers to start on this node, how they meet the other nodes, and how long to wait.

    >>> LaunchConfig(2).collective_timeout
    300.0
    """

    nproc_per_node: int
    """Workers on this node."""
    nnodes: int = 1
    """Nodes taking part; each runs its own launcher with the same ``master_addr:master_port``."""
    node_rank: int = 0
    """0 on the node that hosts the rendezvous store (ranks are handed out in joining order)."""
    master_addr: str = "127.0.0.1"
    """The host of the rendezvous store."""
    master_port: int | None = None
    """The rendezvous store's port; a free one is picked per launch when ``None`` (one node only)."""
    backend: str | None = "gloo"
    """The process group's backend (``"gloo"`` on CPU, ``"nccl"`` on GPUs), or ``None`` for none."""
    join_timeout_s: float = 300.0
    """The longest a launch may take; workers still running then are killed and the launch fails naming
    them. Also the process group's timeout for one collective unless ``collective_timeout_s`` is given."""
    max_restarts: int = 0
    """How often the agent restarts all workers after a failure before giving up."""
    roles: Sequence[str] | Mapping[int, str] | None = None
    """A role label per global rank (a sequence of ``world_size`` labels, or a mapping from rank to label;
    ranks not named are ``"worker"``)."""
    fault_timeout_s: float = 30.0
    """With several nodes, how long a node may stop answering before the others give it up."""
    collective_timeout_s: float | None = None
    """The process group's timeout for one collective (default: ``join_timeout_s``)."""
    checkpoint: str | os.PathLike | None = None
    """A file the workers save their progress to, handed to them as :func:`~.checkpoint_path`."""
    run_id: str | None = None
    """Names the launch in the rendezvous store; every node must use the same one."""

    def __post_init__(self) -> None:
        for name, value, low in (("nproc_per_node", self.nproc_per_node, 1), ("nnodes", self.nnodes, 1),
                                 ("node_rank", self.node_rank, 0), ("max_restarts", self.max_restarts, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"{name}={value!r}: expected an integer >= {low}")
        if self.node_rank >= self.nnodes:
            raise UsageError(f"node_rank={self.node_rank}: expected less than nnodes={self.nnodes}")
        port = self.master_port
        if port is not None and not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
            raise UsageError(f"master_port={port!r}: expected a TCP port 1..65535, or None for a free one")
        if port is None and self.nnodes > 1:
            raise UsageError(f"master_port=None with nnodes={self.nnodes}: every node must name the same port; "
                             "pass master_port")
        for name, seconds in (("join_timeout_s", self.join_timeout_s), ("fault_timeout_s", self.fault_timeout_s),
                              ("collective_timeout_s", self.collective_timeout_s)):
            if seconds is not None and not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                                            and MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S):
                raise UsageError(f"{name}={seconds!r}: expected a number of seconds from {MIN_TIMEOUT_S:g} to "
                                 f"{MAX_TIMEOUT_S:g} (a year)")
        if self.run_id is not None and not (isinstance(self.run_id, str) and self.run_id.strip()):
            raise UsageError(f"run_id={self.run_id!r}: expected a non-empty string, the same on every node")

    @property
    def collective_timeout(self) -> float:
        """The process group's timeout for one collective, in seconds."""
        return float(self.collective_timeout_s or self.join_timeout_s)
