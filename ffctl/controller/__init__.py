"""The controller process (inside `ffctl launch`, on the launch host; never a rank).

Runs the control plane's server side: the controller loop, failure detection, the recovery
coordinator and its pure decision, the fault scheduler, progress, and the client `ffctl inject`
uses to reach it. May import `recovery`, `fault_injectors`, `runs` and `ffctl.agent`'s config.
"""
