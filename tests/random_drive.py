"""One driver for the randomized engine tests (test_scheduler, test_in_batch_sharing,
test_spec_decode): random arrivals, random aborts, the KV manager's invariants after every step,
and the outputs checked against the reference at the end."""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, Iterable, List, Set, Tuple


def random_drive(
    eng: Any,
    rng: random.Random,
    arrive: Callable[[int], Iterable[Tuple[str, List[int]]]],
    more: Callable[[int], bool],
    *,
    steps: int,
    abort_p: float,
    after_step: Callable[[List[Any]], None] = lambda outs: None,
) -> Tuple[Dict[str, List[int]], Set[str], Dict[str, Any]]:
    """Step ``eng`` at most ``steps`` times. Each step: ``arrive(step)`` adds requests and
    returns ``(request_id, expected token ids)`` for each; with probability ``abort_p`` a request
    not finished yet is aborted (drawn from ``rng``); one ``eng.step()``; ``after_step(its
    outputs)``; ``eng.check_integrity()``.
    Stops after a step when ``more(step)`` is false and nothing is unfinished.

    Returns:
        ``(expected, aborted, done)``: expected token ids per request, the aborted ids, and the
        final :class:`RequestOutput` per finished request.
    """
    expected: Dict[str, List[int]] = {}
    aborted: Set[str] = set()
    done: Dict[str, Any] = {}
    for step in range(steps):
        expected.update(arrive(step))
        if expected and rng.random() < abort_p:
            rid = rng.choice(sorted(expected))
            if rid not in done:
                eng.abort_request(rid)
                aborted.add(rid)
        outs = eng.step()
        for out in outs:
            if out.finished:
                done[out.request_id] = out
        after_step(outs)
        eng.check_integrity()
        if not more(step) and not eng.has_unfinished_requests():
            break
    return expected, aborted, done


def assert_outputs(expected: Dict[str, List[int]], aborted: Set[str], done: Dict[str, Any]) -> None:
    """Every request finished; each sample equals its reference, or, aborted, a prefix of it."""
    assert set(done) == set(expected)
    for rid, out in done.items():
        for c in out.outputs:
            if c.finish_reason == "abort":
                assert rid in aborted
                assert c.token_ids == expected[rid][: len(c.token_ids)]
            else:
                assert c.token_ids == expected[rid]
