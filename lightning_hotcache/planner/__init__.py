"""Which rows stay on the device: access profiling (`profiling`), the hot/cold plan
(`plan`) and the traffic model of a plan (`traffic`). The plan's names are re-exported here."""

from lightning_hotcache.planner.plan import (
    PLAN_FORMAT_VERSION,
    Budget,
    HotColdPlan,
    HotColdPlanner,
    StatsNeededError,
    TablePlan,
    batches_in_flight,
    format_bytes,
    resolve_budget,
    row_bytes,
)

__all__ = [
    "PLAN_FORMAT_VERSION",
    "Budget",
    "HotColdPlan",
    "HotColdPlanner",
    "StatsNeededError",
    "TablePlan",
    "batches_in_flight",
    "format_bytes",
    "resolve_budget",
    "row_bytes",
]
