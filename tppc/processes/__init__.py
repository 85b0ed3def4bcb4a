"""Processes and the files they own: a job of local ranks and what it leaves behind.

``owned_files`` owner-locked files and directories, swept once their owner died;
``rank_exit`` how a rank ends (signals, its launcher's death); ``launch`` ``tppc.launch``: a
job of local ranks.
"""

from __future__ import annotations

__all__: list[str] = []
