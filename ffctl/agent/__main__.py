"""`python -m ffctl.agent`: how the controller starts a node agent, locally or over SSH."""
from __future__ import annotations

import sys

from ffctl.agent.agent import main

sys.exit(main())
