"""`ffctl agent`: the node agent (started by the controller; reads its config from stdin)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("agent", hidden=True)
    def agent() -> int:
        """Run a node agent. The controller starts this; its configuration arrives on stdin."""
        from ffctl.agent.agent import main

        return main()
