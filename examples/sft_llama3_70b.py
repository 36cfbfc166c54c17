"""Supervised fine-tuning of Llama-3-70B on 8 nodes of 8 H100s, built with the graph API.

    planner compile examples/sft_llama3_70b.py
"""

from planner import Graph

CLUSTER = "h100-sxm:8x8"

g = Graph("sft_llama3_70b", batch=512, seq_len=4096, algorithm={"name": "sft", "lr": 1e-5})
model = g.model("model", "llama-3-70b", trainable=True)
model.train(g.input("tokens"), loss="sft", name="model_train")
graph = g.build()
