"""The coordinator side of the runtime: discovery, connections, membership, and jobs on agents."""
from swarm.cluster.cluster import Cluster, open_cluster
from swarm.cluster.devices import Device
from swarm.cluster.jobs import CoordinatorJob, JobError
from swarm.membership import MembershipEvent

__all__ = ["Cluster", "open_cluster", "Device", "CoordinatorJob", "JobError", "MembershipEvent"]
