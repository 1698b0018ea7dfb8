"""One way to write a duration on every command line: `5`, `2.5s`, `500ms`, `2m`, `3h`, `1d`
(`wire.fault_spec.parse_seconds`, the same grammar as a fault spec's `duration=` and `t=`)."""
from __future__ import annotations

import math

from ffctl.exits import BadInput
from wire.fault_spec import parse_seconds

EXAMPLES = "5, 2.5s, 500ms, 2m or 3h"


def parse_duration(text: str, option: str) -> float:
    """`text` as seconds, more than 0; BadInput naming `option` and the value otherwise."""
    value = parse_seconds(text)
    if value is None or not 0 < value < math.inf:
        raise BadInput(f"{option} {text!r}: not a positive duration like {EXAMPLES}")
    return value
