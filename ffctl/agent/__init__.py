"""The node agent process (`python -m ffctl.agent`, one per host) and the workers it starts.

Runs on every training host: the agent loop, warm spares, the worker template and the workers'
environment. May import `recovery`, `fault_injectors` and `runs`; never the controller, the
launch path or the CLI (it talks to the controller only through the control plane).
"""
