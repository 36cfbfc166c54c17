"""planner: compile LLM training and RLHF workloads into execution plans.

    from planner import Graph, compile_graph
    from planner.algorithms import ppo
"""

from planner.compile import compile_graph
from planner.graph import Data, Graph, ModelHandle

__all__ = ["Data", "Graph", "ModelHandle", "compile_graph"]
