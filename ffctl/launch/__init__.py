"""What `ffctl launch` (and `ffctl run`, `ffctl inject revert`) do before and around the controller.

Runs in the CLI's process: the launch spec and scenario files, the pure plan, the one execute
path over a node backend of `ffctl.backends`; cleanup. May import the controller, the backends,
`ffctl.hosts` and the lower packages; never the CLI or rendering.
"""
