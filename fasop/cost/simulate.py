"""A reference event simulation of Megatron-LM's 1F1B pipeline schedule.

fasop ranks plans with the closed form of docs/cost-model.md section 4, which its partitioner can optimise
exactly; this simulation runs the schedule event by event to check that form (tests/test_costmodel.py) and to
measure how far it lands (scripts/measure_accuracy.py).
"""

from __future__ import annotations

import heapq


def simulate_1f1b(forward: list[float], backward: list[float], send: list[float], m: int) -> float:
    """Event simulation of Megatron's 1F1B schedule: stage i runs min(P-1-i, m) warm-up forwards, then
    alternates one forward and one backward, then drains its backwards. After a forward a stage sends the
    activation downstream, after a backward the gradient upstream; it is busy for the send (blocking), and
    the receiver may start once the send has ended. Returns when stage 0 finishes its last backward.

    forward[i], backward[i]: seconds of one micro-batch on stage i; send[j]: seconds of one transfer across
    boundary j (stage j to j + 1); m: micro-batches."""
    p = len(forward)
    programs = []
    for i in range(p):
        warm = min(p - 1 - i, m)
        ops = [("F", j) for j in range(warm)]
        for j in range(m - warm):
            ops += [("F", j + warm), ("B", j)]
        programs.append(ops + [("B", j) for j in range(m - warm, m)])
    ready = {("F", 0, j): 0.0 for j in range(m)}  # inputs of stage 0 are there at time 0
    clock, position = [0.0] * p, [0] * p
    events: list[tuple] = []
    waiting = set(range(p))
    finish = 0.0
    while waiting or events:
        for i in sorted(waiting):
            kind, j = programs[i][position[i]]
            key = (kind, i, j) if not (kind == "B" and i == p - 1) else ("F", i, j)
            if key in ready:
                waiting.discard(i)
                start = max(clock[i], ready[key] if kind == "F" or i < p - 1 else clock[i])
                end = start + (forward[i] if kind == "F" else backward[i])
                if kind == "F" and i < p - 1:
                    end += send[i]
                    heapq.heappush(events, (end, ("F", i + 1, j)))
                if kind == "B" and i > 0:
                    end += send[i - 1]
                    heapq.heappush(events, (end, ("B", i - 1, j)))
                if kind == "B" and i == 0:
                    finish = max(finish, end)
                heapq.heappush(events, (end, ("free", i, None)))
        if not events:
            break
        when, (what, i, j) = heapq.heappop(events)
        if what == "free":
            clock[i] = when
            position[i] += 1
            if position[i] < len(programs[i]):
                waiting.add(i)
        else:
            ready[(what, i, j)] = when
    return finish
