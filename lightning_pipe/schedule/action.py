"""The action IR: what one rank does at one point of a schedule.

An action is written compactly as ``"<stage><kind><microbatch>"``: ``"1F3"`` is the forward of
microbatch 3 on stage 1. Compute kinds are ``F`` (forward), ``B`` (the whole backward) and, for
zero-bubble schedules, the backward in two parts: ``I`` (the gradient of the stage's input only,
which the previous stage waits for) and ``W`` (the gradient of the stage's weights, run later to
fill a bubble; it never communicates). A stage/microbatch has either one ``B`` or one ``I`` and a
later ``W``. The lowering pass
(:mod:`lightning_pipe.schedule.lower`) adds communication kinds: ``SF``/``RF`` send/receive a
microbatch's activations, ``SB``/``RB`` its gradients, ``SS``/``RS`` its skip tensors (straight
from the stashing stage to the popping stage) and ``SG``/``RG`` their gradients. A communication
action's ``stage_index`` is the stage on the acting rank; its ``peer`` is the stage on the other
side.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

F = "F"
B = "B"
I = "I"
W = "W"
SEND_F = "SF"
RECV_F = "RF"
SEND_B = "SB"
RECV_B = "RB"
SEND_SKIP = "SS"
RECV_SKIP = "RS"
SEND_SKIP_GRAD = "SG"
RECV_SKIP_GRAD = "RG"

COMPUTE_KINDS = (F, B, I, W)
BACKWARD_KINDS = (B, I)  # the kinds that receive output gradients and send input gradients
SEND_KINDS = (SEND_F, SEND_B, SEND_SKIP, SEND_SKIP_GRAD)
RECV_KINDS = (RECV_F, RECV_B, RECV_SKIP, RECV_SKIP_GRAD)
COMM_KINDS = SEND_KINDS + RECV_KINDS
KINDS = COMPUTE_KINDS + COMM_KINDS

_PATTERN = re.compile(r"^(\d+)(SF|RF|SB|RB|SS|RS|SG|RG|F|B|I|W)(\d+)(?:@(\d+))?$")


class Action(NamedTuple):
    """One step of one rank's schedule.

    Example:
        >>> Action("F", 1, 3)
        1F3
        >>> Action.parse("0SF2@1")
        0SF2@1
        >>> Action.parse("0SF2@1").peer
        1
    """

    kind: str
    stage_index: int
    microbatch_index: int
    peer: Optional[int] = None

    def __repr__(self) -> str:
        text = f"{self.stage_index}{self.kind}{self.microbatch_index}"
        return text if self.peer is None else f"{text}@{self.peer}"

    __str__ = __repr__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read an action from its compact form (``"1F3"``, ``"0SF2@1"``)."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected '<stage><kind><microbatch>[@<peer>]' "
                f"with kind one of {KINDS}, e.g. '1F3'"
            )
        stage, kind, microbatch, peer = match.groups()
        return cls(kind, int(stage), int(microbatch), None if peer is None else int(peer))


Table = tuple  # one tuple of Actions per rank: Table[rank][step] -> Action


def parse_table(rows: "list[str]") -> tuple:
    """Read a table written as one whitespace-separated row of actions per rank.

    Example:
        >>> parse_table(["0F0 0B0"])
        ((0F0, 0B0),)
    """
    return tuple(tuple(Action.parse(token) for token in row.split()) for row in rows)


def format_rows(tables: tuple, marks: "dict | None" = None) -> str:
    """List each rank's row as written, with ``<-- ERROR HERE`` after marked actions.

    Example:
        >>> print(format_rows(parse_table(["0F0 0B0"]), {0: 1}))
        rank 0: 0F0 0B0 <-- ERROR HERE
    """
    marks = marks or {}
    lines = []
    for r, row in enumerate(tables):
        tokens = []
        for j, a in enumerate(row):
            tokens.append(str(a) + (" <-- ERROR HERE" if marks.get(r) == j else ""))
        if marks.get(r) == len(row):
            tokens.append("<-- ERROR HERE")
        lines.append(f"rank {r}: " + " ".join(tokens))
    return "\n".join(lines)
