"""The agent (`swarm join`): serves connections, answers probes, runs jobs it is given."""
from swarm.agent.agent import DEFAULT_PORT, Agent, AgentConfig
from swarm.agent.jobs import JOB_KINDS, Inbound, JobContext, job_kind, job_runner, register_job_kind

__all__ = ["DEFAULT_PORT", "Agent", "AgentConfig", "JOB_KINDS", "Inbound", "JobContext", "job_kind", "job_runner",
           "register_job_kind"]
