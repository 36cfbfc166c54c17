"""planner: compile LLM training and RLHF workloads into execution plans.

    from planner import Graph, compile_graph
    from planner.algorithms import ppo

or trace a training loop written as a function: ``@planner.auto(...)`` with ``@planner.host``
steps (`planner.auto`).
"""

from planner.auto import AutoFunction, auto, model
from planner.compile import compile_graph
from planner.graph import Data, Graph, ModelHandle
from planner.tracing import host

__all__ = ["AutoFunction", "Data", "Graph", "ModelHandle", "auto", "compile_graph", "host", "model"]
