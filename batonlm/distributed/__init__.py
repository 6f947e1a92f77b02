"""Tensor parallelism across processes and nodes: how a model is split (`layout`), the process
group its ranks talk over (`group`), and what crosses it each iteration (`relay`)."""
