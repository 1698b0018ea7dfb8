"""The hosts a job runs on, seen from the launch host: hostfiles, SSH, preflight checks, doctor.

Runs in the CLI's process. paramiko is imported only under `hosts/ssh/`. May import
`fault_injectors` (its transports and probes), `runs` and `ffctl.agent`'s config; never the
controller loop, the CLI or rendering.
"""
