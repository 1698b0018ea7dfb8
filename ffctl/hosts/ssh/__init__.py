"""SSH to the hosts: the paramiko transport (the only module that imports paramiko) and the node
backend that starts one agent per host over it."""
