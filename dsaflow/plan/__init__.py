"""Planning: the layout language (layout.py), the Plan dataclasses (plan.py), the planner (planner.py) and its
renderings (render.py). Pure Python: no torch.distributed, no GPU."""

from dsaflow.plan.plan import GraphBlockPlan, LayerPlan, PipelinePlan, Plan, StagePlan
from dsaflow.plan.planner import build_plan
from dsaflow.plan.render import render_table

__all__ = ["Plan", "LayerPlan", "StagePlan", "GraphBlockPlan", "PipelinePlan", "build_plan", "render_table"]
