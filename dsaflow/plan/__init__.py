"""Planning: the Plan dataclasses (plan.py), the planner (planner.py) and its renderings (render.py).

`build_plan` and `render_table` are imported lazily so that `dsaflow.plan.plan` (which workers and the config
package import) never pulls in the planner and its config dependencies.
"""
from dsaflow.plan.plan import GraphBlockPlan, LayerPlan, PipelinePlan, Plan, PlanError, StagePlan

__all__ = ["Plan", "LayerPlan", "StagePlan", "GraphBlockPlan", "PipelinePlan", "PlanError", "build_plan", "render_table"]


def __getattr__(name):
    if name == "build_plan":
        from dsaflow.plan.planner import build_plan

        return build_plan
    if name == "render_table":
        from dsaflow.plan.render import render_table

        return render_table
    raise AttributeError(f"module 'dsaflow.plan' has no attribute {name!r}")
