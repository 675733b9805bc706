"""Offline replay: a trace through the fleet engine's lanes, summarised as the paper's comparison."""

from shadow.replay.experiment import DEFAULT_POLICIES, ReplayReport, ReplaySetup, run_replay

__all__ = ["DEFAULT_POLICIES", "ReplayReport", "ReplaySetup", "run_replay"]
