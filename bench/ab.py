"""A/B two builds of the single file: contextwarden inlet next turn, re-selecting warm turn and cold, interleaved.

    bench/.venv/bin/python bench/ab.py BEFORE.py AFTER.py [--sizes 200 1000] [--reps 40]

For committing an optimisation with before/after numbers: both builds load as Open WebUI
loads them, alternate within every repetition on fresh copies of the same bodies, and the
paired ratio after/before is reported (robust to load from other processes). The file loaded
second runs cold chats ~1.1x slower whatever its code (an A/A run shows it): for cold figures,
run it both ways (`ab.py A B`, `ab.py B A`) and take the geometric mean of the two ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402
import synth  # noqa: E402


async def main(paths: list[Path], sizes: list[int], reps: int) -> None:
    builds = []
    for path in paths:
        module = speed.load_bundle(path)
        builds.append((path.name, module, await speed.make_filter(module)))
    for n in sizes:
        base = synth.make_chat(10_000_000 + n, n)
        for _, module, f in builds:
            await speed.cw_inlet(f, module, speed.fresh(base))
        times: dict[tuple[str, str], list[float]] = {}
        going = list(base)  # "next": one chat that goes on, each reply through outlet first (as in Open WebUI)
        for rep in range(reps):
            pair = synth.next_turn(n * 100_000 + 50_000 + rep)
            going = going + pair
            bodies = {"next": going, "warm": base + pair, "cold": synth.make_chat(n * 100_000 + rep, n)}
            order = builds if rep % 2 == 0 else builds[::-1]
            for kind, chat in bodies.items():
                for label, module, f in order:
                    body = speed.request_body(speed.fresh(chat), f"ab-{n}-{kind}-{rep if kind == 'cold' else ''}")
                    user = {"id": "u", "valves": module.Filter.UserValves()}
                    if kind == "next":
                        await speed.cw_outlet(f, user, chat[:-1], body["metadata"]["chat_id"])
                    gc.collect()
                    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                    await f.inlet(
                        body,
                        __user__=user,
                        __metadata__=body["metadata"],
                        __model__={"id": speed.MODEL},
                        __event_emitter__=speed._emit,
                    )
                    times.setdefault((kind, "wall", label), []).append((time.perf_counter_ns() - t0) / 1e6)
                    times.setdefault((kind, "cpu", label), []).append((time.thread_time_ns() - c0) / 1e6)
        for kind in ("next", "warm", "cold"):
            for clock in ("wall", "cpu"):
                (a, ta), (b, tb) = [(label, times[(kind, clock, label)]) for label, _, _ in builds]
                ratios = [y / x for x, y in zip(ta, tb, strict=True)]
                q = statistics.quantiles(ratios, n=4, method="inclusive")
                print(
                    f"{n:>5} msgs {kind} {clock}: {a} {statistics.median(ta):.3f} ms, "
                    f"{b} {statistics.median(tb):.3f} ms; "
                    f"paired {b}/{a} median {q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}), {reps} reps"
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 200, 1000])
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    speed.seed_encodings()
    asyncio.run(main([args.before, args.after], args.sizes, args.reps))
