"""SSH to the hosts: the connection (`connection`) and transport (`transport`), the only modules
that import paramiko, and the checks every host passes before a run over SSH (`preflight`). The
SSH node backend that starts one agent per host over them is `ffctl.backends.ssh`."""
