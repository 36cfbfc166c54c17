"""planner: compile LLM training and RLHF workloads into execution plans."""
