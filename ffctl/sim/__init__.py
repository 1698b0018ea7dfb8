"""Simulated nodes: the control plane at a scale no test machine has.

`ffctl.sim.agents` is one process (`python -m ffctl.sim`) that runs many node agents, each
speaking the real, sealed control protocol (`wire.control`, `wire.messages`) to a real
controller over its real store, with simulated ranks that report steps and snapshots and do no
torch work. `ffctl.sim.nodes` is the node backend that hands the controller's agent starts to that
process, and `ffctl.sim.control_plane` runs `ffctl bench --only control-plane`: a real controller, a
simulated node lost, the recovery's control-plane phases measured per cluster size.
"""
