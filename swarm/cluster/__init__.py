"""The coordinator side of the runtime: the roster of agents (discovery, connections), their
membership (heartbeats and probes), and jobs on agents."""
from swarm.cluster.members import Member
from swarm.cluster.membership import MembershipEvent
from swarm.cluster.remote_job import CoordinatorJob, JobError
from swarm.cluster.roster import Roster, open_roster

__all__ = ["Roster", "open_roster", "Member", "CoordinatorJob", "JobError", "MembershipEvent"]
