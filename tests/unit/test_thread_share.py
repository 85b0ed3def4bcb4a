"""Workers with no thread count of their own share the caller's intra-op threads."""

from __future__ import annotations

import torch

from tppc.backends.torch_threads import thread_share


def test_the_callers_threads_are_shared_among_the_workers() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert (thread_share(1), thread_share(2), thread_share(3), thread_share(8)) == \
            (None, 2, 1, 1)
        torch.set_num_threads(1)
        assert thread_share(2) == 1
    finally:
        torch.set_num_threads(before)

