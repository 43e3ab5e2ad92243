"""Reference event simulations of Megatron-LM's 1F1B pipeline schedule, plain and interleaved.

fasop ranks plans with the closed form of docs/cost-model.md section 4, which its partitioner can optimise
exactly; these simulations run the schedule event by event to check that form (tests/test_costmodel.py), to
measure how far it lands (scripts/measure_accuracy.py) and to check the exact schedule of fasop/cost/schedule.py
(tests/test_schedule.py).
"""

from __future__ import annotations

import heapq
import itertools


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


def megatron_order(p: int, rank: int, m: int, v: int, group: int) -> list[tuple[str, int, int]]:
    """The (kind, chunk, micro-batch) operations of pipeline rank `rank` under Megatron's interleaved schedule,
    following megatron/core/pipeline_parallel/schedules.py step by step: the lookup table of
    get_schedule_table, the warm-up count of get_pp_rank_microbatches, the warm-up, 1F1B and cool-down loops
    of forward_backward_pipelining_with_interleaving, backwards taking chunk v - 1 - (forward chunk)."""
    table = []
    for low in range(0, m, group):
        high = m if low + group >= m else low + group
        table += [(j, c) for c in range(v) for j in range(low, high)]
    total = m * v
    # v = 1 is Megatron's plain schedule (forward_backward_pipelining_without_interleaving)
    warm = min(p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * group, total)
    forward = [("F", c, j) for j, c in table]
    backward = [("B", v - 1 - c, j) for j, c in table]
    order = forward[:warm]
    for k in range(total - warm):
        order += [forward[k + warm], backward[k]]
    return order + backward[total - warm:]


def simulate_interleaved_1f1b(forward: list[list[float]], backward: list[list[float]], send: list[float],
                              wrap_send: float, m: int, group: int | None = None) -> float:
    """Event simulation of Megatron's interleaved 1F1B schedule with v = len(forward[0]) model chunks per
    stage: model chunk c of stage i is virtual stage c * P + i, activations flow through the virtual stages in
    order (from the last stage back to the first over the wrap-around link, `wrap_send` seconds) and gradients
    the other way. Sends are blocking as in simulate_1f1b. Returns when the last operation ends.

    forward[i][c], backward[i][c]: seconds of one micro-batch on chunk c of stage i; send[j]: seconds across
    boundary j; group: micro-batches per group (default P)."""
    p, v = len(forward), len(forward[0])
    orders = [megatron_order(p, i, m, v, group or p) for i in range(p)]
    last = p * v - 1
    # inputs that have arrived, by (kind, virtual stage, micro-batch): those of virtual stage 0 at time 0
    arrived: dict[tuple[str, int, int], float] = {("F", 0, j): 0.0 for j in range(m)}
    position, free_at, busy = [0] * p, [0.0] * p, [False] * p
    events: list[tuple[float, int, tuple]] = []  # (time, sequence number to break ties, event)
    sequence = itertools.count()

    def post(when: float, event: tuple) -> None:
        heapq.heappush(events, (when, next(sequence), event))

    def try_start(i: int) -> None:
        if busy[i] or position[i] == len(orders[i]):
            return
        kind, c, j = orders[i][position[i]]
        s = c * p + i
        if (kind, s, j) not in arrived:
            return  # tried again when the input arrives
        end = max(free_at[i], arrived[(kind, s, j)]) + (forward[i][c] if kind == "F" else backward[i][c])
        if kind == "F" and s < last:
            end += send[i] if i < p - 1 else wrap_send
            post(end, ("F", s + 1, j))
        elif kind == "F":
            post(end, ("B", s, j))  # the last virtual stage turns the micro-batch around
        elif s > 0:
            end += send[i - 1] if i > 0 else wrap_send
            post(end, ("B", s - 1, j))
        position[i] += 1
        free_at[i], busy[i] = end, True
        post(end, ("free", i))

    for i in range(p):
        try_start(i)
    while events:
        when, _, event = heapq.heappop(events)
        if event[0] == "free":
            busy[event[1]] = False
            try_start(event[1])
        else:
            arrived[event] = when
            try_start(event[1] % p)
    if position != [len(order) for order in orders]:
        raise RuntimeError("the schedule deadlocks")
    return max(free_at)
