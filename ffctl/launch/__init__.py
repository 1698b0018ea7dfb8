"""What `ffctl launch` (and `ffctl run`, `ffctl inject revert`) do before and around the controller.

Runs in the CLI's process: the launch spec and scenario files, the pure plan, the one execute
path, and the node backends that start agents (local processes, netns sandbox); cleanup. May
import the controller, `ffctl.hosts` and the lower packages; never the CLI or rendering.
"""
